"""readie router: gRPC front end and the pool JSONL protocol."""
