"""The gateway: Continuum's only client-facing process (docs/design.md §1). It owns everything
textual and relays token streams from the scheduler replicas; docs/architecture.md maps
each module. Subpackages: rpc/ (gRPC front), api/ (OpenAI HTTP), edge/ (connection
defences, probes), admit/ (the admit step), text/, tools/, structured/, routing/."""
