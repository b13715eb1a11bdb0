"""Publishing verl's prompts as prompt groups: the side both managers share."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rolloutbus.config import Config
from rolloutbus.producers.publish import PromptPublisher, build_group
from rolloutbus.schemas.prompts import PromptGroup
from rolloutbus.verl.rows import PromptRequest

__all__ = ["publish_requests"]

log = logging.getLogger(__name__)


def publish_requests(
    cfg: Config,
    publisher: PromptPublisher,
    requests: Sequence[PromptRequest],
    *,
    validate: bool,
    global_steps: int,
) -> list[PromptGroup]:
    """Publish one prompt group per request, with verl's uid, and wait until the broker has
    them all (``flush``). A uid published before (a re-dispatch after a restart) costs
    nothing: the sessions skip a uid they have started and the replay buffer never releases
    a uid twice."""
    groups = [
        build_group(cfg, r.row, validate=validate, global_steps=global_steps, uid=r.uid)
        for r in requests
    ]
    for group in groups:
        publisher.publish_group(group)
    publisher.flush()
    log.info(
        "published %d prompt groups (global_steps %d%s)",
        len(groups),
        global_steps,
        ", validation" if validate else "",
    )
    return groups
