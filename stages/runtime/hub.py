"""Whether the Hugging Face hub can be reached, decided as huggingface_hub decides it: its offline switch
(HF_HUB_OFFLINE), its endpoint (HF_ENDPOINT) and its HTTP session, which honours HTTPS_PROXY and the
other proxy variables. A hub path fails fast offline instead of retrying for half a minute."""

from __future__ import annotations

import os

TRUE = ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub read it at import or as the environment says now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE


def reachable(timeout: float = 3.0) -> bool:
    """The hub answers (any status) within timeout, through huggingface_hub's own session."""
    if offline():
        return False
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(f"{constants.ENDPOINT}/api/models", timeout=timeout)
    except Exception:  # noqa: BLE001 - refused, unresolved, timed out, a proxy that says no: not reachable
        return False
    return True
