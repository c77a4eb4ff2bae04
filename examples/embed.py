"""hicache in a toy scheduler loop: requests share a system prompt and grow turn by turn;
each reuses what the cache holds (on the device, or loaded back from the host) and caches
its own pages. A real engine runs its forward where the comment says (hicache/engine/)."""

import dataclasses

import torch

from hicache import IndexSpace, Indices, build_service, load_default_config

config = load_default_config()  # a small hybrid model on the CPU; metrics on a free port:
# and a device pool of 320 tokens, so that the conversations outgrow it and come back
# from the host
config = dataclasses.replace(
    config, service=dataclasses.replace(config.service, metrics_port=0),
    device_pool=dataclasses.replace(config.device_pool, num_tokens=320))
system_prompt = list(range(1000, 1128))
with build_service(config) as service:
    for step in range(12):  # three conversations, taking turns
        prompt = system_prompt + [step % 3] * 32 * (1 + step // 3)  # whole pages of 16
        service.step()  # every scheduler step: apply finished transfers
        key = service.key(prompt)  # the tokens checked once, for match and insert
        match = service.match(key)
        service.lock(match.last_host_node)  # keep the prefix until the request is done
        prefix = match.device_indices
        loaded_tokens = 0
        if match.host_hit_tokens:
            loaded = service.load_back(match, 1024)  # a LoadBack: queued, or why not
            if loaded.queued:
                prefix = Indices(torch.cat([prefix.tensor, loaded.device_indices.tensor]),
                                 IndexSpace.DEVICE_FULL)
                loaded_tokens = loaded.num_tokens
        own = service.alloc_device(len(prompt) - len(prefix))
        assert own is not None, "device pool full: a real scheduler would wait or retract"
        service.start_loading()
        # forward: compute the KV of prompt[len(prefix):] and write it into the rows `own`
        # (service.device_pool.set_kv); a hybrid model first checks the SWA window of prefix
        slots = Indices(torch.cat([prefix.tensor, own.tensor]), IndexSpace.DEVICE_FULL)
        service.insert(key, slots)
        service.release(match.last_host_node)
        print(f"request {step}: {len(prompt)} tokens, {len(match.device_indices)} from the "
              f"device, {loaded_tokens} loaded back from the host")
