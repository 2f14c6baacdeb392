"""`python -m batch_pipeline.webhooks`: the delivery loop, until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from batch_pipeline.core.settings import SettingsError, settings
from batch_pipeline.tenancy.tenants import TenantsFileError, tenants_at
from batch_pipeline.webhooks.delivery import Deliverer, WebhookSecretError, check_webhook_secrets


def main() -> int:
    # Our lines at INFO, the libraries' at WARNING: httpx logs each request's URL at INFO, and a team's URL
    # may carry a token (this process logs endpoints by their place in the team's list, never by URL).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s webhooks %(levelname)s %(message)s")
    logging.getLogger("batch_pipeline").setLevel(logging.INFO)
    try:
        configured = settings()
        check_webhook_secrets(tenants_at(configured.tenants))
    except (SettingsError, TenantsFileError, WebhookSecretError) as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    Deliverer.of_deployment(configured).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
