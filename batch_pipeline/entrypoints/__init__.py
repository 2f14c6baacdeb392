"""The ways in: the `batch-pipeline` command, the API client it uses, and `make serve` (the whole deployment on
one machine)."""
