"""The job store's schema as versioned Alembic migrations: jobs outlive deployments, so every release
upgrades the database it finds (`store.engine.upgrade_schema`), whichever release created it."""
