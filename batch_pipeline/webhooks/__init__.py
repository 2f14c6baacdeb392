"""Signed webhooks when a job ends: the delivery process (`python -m batch_pipeline.webhooks`, started by
`serve`) sends the job store's outbox to the endpoints the tenants file gives each team."""
