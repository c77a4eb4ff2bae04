"""One conversation alone, growing past the SWA pool, through the reference engine.

On the default (hybrid) config (1024 full tokens, a 256-token SWA pool holding four 64-token
windows) one conversation failed at turn 6, a 257-token sequence: "nothing else can be
evicted; raise device_pool.num_tokens or device_pool.swa_num_tokens". The engine made room
for a request's window only while others ran; admitted alone, the request locked its whole
device prefix, SWA rows included (a locked node's SWA rows are not evicted, though only its
last window is read), and under ``write_back`` it gave up before the step that frees the
pages evictions wrote back. The engine now makes that room before every admission.

Left as it is (see the README's hybrid section): the tree keeps every SWA row of a locked
prefix, so ``write_back`` can still run out of SWA slots on such a conversation.
"""

from __future__ import annotations

import dataclasses

import pytest

from hicache.config import WritePolicy, load_default_config
from hicache.engine import DemoOptions, run_demo


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH,
                                    WritePolicy.WRITE_THROUGH_SELECTIVE])
def test_one_conversation_longer_than_the_swa_pool_is_served(policy: WritePolicy) -> None:
    config = load_default_config(check_ram=False)
    config = dataclasses.replace(config, service=dataclasses.replace(
        config.service, metrics_enabled=False))
    report = run_demo(config, DemoOptions(conversations=1, turns=8, write_policy=policy))
    assert report.passed, report.failure()
