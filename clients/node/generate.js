#!/usr/bin/env node
// A Node client of continuum.v1.Generation, built from the .proto files alone with
// @grpc/grpc-js and @grpc/proto-loader, on a channel that runs the contract's service
// config (protos/continuum/v1/service_config.json: gRPC's own retries, after the server's
// grpc-retry-pushback-ms). It knows nothing of this repository's Python (docs/grpc.md).
//
//   node clients/node/generate.js HOST:PORT '{"prompt": "Hello", "max_tokens": 16}'
//
// The request is a GenerateRequest as a JSON object with the .proto's field names. Every
// GenerateResponse is printed as one JSON line {"response": {...}}, then one last line
// {"status": "OK" | code name, "details", "attempts", "first_message_ms", "trailers"}:
// attempts counts the tries gRPC's retry layer made (its grpc-previous-rpc-attempts + 1),
// first_message_ms the milliseconds from the call to its first message (null: none).
// Exits 0 when the call ended OK, 1 otherwise.
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

// The directory holding protos/: the files import each other as "protos/continuum/v1/...".
const ROOT = path.resolve(__dirname, "..", "..");
const PROTO = "protos/continuum/v1/generation.proto";
const SERVICE_CONFIG = path.join(ROOT, "protos", "continuum", "v1", "service_config.json");
const PREVIOUS_ATTEMPTS = "grpc-previous-rpc-attempts";

function generationClient(address) {
  const definition = protoLoader.loadSync(PROTO, {
    includeDirs: [ROOT],
    keepCase: true, // the .proto's field names: max_tokens, finish_reason, ...
    longs: String,
    enums: String, // "FINISH_REASON_LENGTH"
    defaults: true, // zero values are printed too (queue_time_s: 0)
    oneofs: true,
  });
  const v1 = grpc.loadPackageDefinition(definition).continuum.v1;
  return new v1.Generation(address, grpc.credentials.createInsecure(), {
    "grpc.service_config": fs.readFileSync(SERVICE_CONFIG, "utf8"),
    "grpc.enable_retries": 1,
  });
}

function attemptsIn(metadata, seen) {
  const previous = metadata.get(PREVIOUS_ATTEMPTS);
  return previous.length ? Number(previous[0]) + 1 : seen;
}

function generate(address, request) {
  const client = generationClient(address);
  const started = Date.now();
  let attempts = 1;
  let firstMessageMs = null;
  const print = (line) => process.stdout.write(JSON.stringify(line) + "\n");
  const call = client.Generate(request);
  call.on("metadata", (metadata) => { attempts = attemptsIn(metadata, attempts); });
  call.on("data", (response) => {
    if (firstMessageMs === null) firstMessageMs = Date.now() - started;
    print({ response });
  });
  call.on("error", () => {}); // the status below says what happened
  call.on("status", (status) => {
    attempts = attemptsIn(status.metadata, attempts);
    print({
      status: Object.keys(grpc.status).find((name) => grpc.status[name] === status.code),
      details: status.details,
      attempts,
      first_message_ms: firstMessageMs,
      trailers: status.metadata.getMap(),
    });
    client.close();
    process.exitCode = status.code === grpc.status.OK ? 0 : 1;
  });
}

if (require.main === module) {
  const [address, requestJson] = process.argv.slice(2);
  if (!address || !requestJson) {
    process.stderr.write("usage: generate.js HOST:PORT REQUEST_JSON\n");
    process.exit(2);
  }
  generate(address, JSON.parse(requestJson));
}

module.exports = { generate, generationClient };
