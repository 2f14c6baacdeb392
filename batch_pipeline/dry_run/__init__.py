"""The dry run: a request read, checked and tokenized as its job would be, short of loading weights, and its
cost estimated; in a child process, since it reaches into the worker's request handlers."""
