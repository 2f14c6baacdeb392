"""OpenAI's Batch API as jobs: a batch's input file checked into its job's content, and the job's output turned into
OpenAI's output and error files."""
