"""The one base class of every wire type."""

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    # Clients of this API (Scale's llmengine SDK, OpenAI-style tooling) send fields newer or older than ours;
    # like the reference server, unknown fields are ignored rather than refused. `model_*` field names are
    # part of the wire format, so pydantic's protected namespace is lifted.
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True)
