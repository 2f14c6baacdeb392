"""Persistence: the job store (jobs, their figures and labels), OpenAI files and batches as rows, and the
Alembic migrations of their schema."""
