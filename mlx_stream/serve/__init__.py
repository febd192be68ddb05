"""The server: the engine, its HTTP app and the translations of each API into one request."""
