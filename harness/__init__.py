"""What tests and benchmarks drive the system with: the servers they start, the client
streams they send, the fakes and fuzz strategies they share (docs/architecture.md,
"harness/"). Tests and benchmarks import it; no service or CLI module does."""
