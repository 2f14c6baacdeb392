"""What a request must pass before it is stored as a job: its capabilities, hardware bounds and paths,
checked once; then the submission that stores it."""
