"""The head: CLI, pipeline client, scheduler, engine and HTTP API. It holds no weights."""
