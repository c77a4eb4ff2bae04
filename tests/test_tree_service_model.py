"""Model-based test of the radix tree with its two tiers, driven through HiCacheService.

Observe-and-validate model: after every rule the tree is read as a page map
(page prefix -> device slots, host slots, backed up) and each change is checked against
what the rule may do; the model keeps its own LRU clock, engine locks, and the sequences
inserted. Checks: match lengths, the tier of each page, slot ownership (independently of
check_integrity), row contents on both tiers, eviction order, and no leak at teardown.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from radix_helpers import expected_rows, read_rows, write_rows

from hicache.config import config_from_dict
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.radix.key import key_tokens

# a longer run: HICACHE_MODEL_EXAMPLES=150 HICACHE_MODEL_STEPS=60 (about 1.5 min on 2 cores)
EXAMPLES = int(os.environ.get("HICACHE_MODEL_EXAMPLES", "40"))
STEPS = int(os.environ.get("HICACHE_MODEL_STEPS", "30"))
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=list(HealthCheck))


def make_service(page: int, policy: str, device_pages: int, eviction: str = "lru",
                 ratio: float = 2.0):
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    return build_service(config_from_dict({
        "page_size_tokens": page, "model": model,
        "device_pool": {"num_tokens": page * device_pages, "device": "cpu"},
        "host": {"ratio": ratio, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": policy,
                       "load_back_threshold_tokens": 0, "write_through_hits": 2,
                       "eviction_policy": eviction},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 1000.0},
    }))


def cat(parts):
    parts = [p.tensor for p in parts if p is not None and len(p)]
    if not parts:
        return Indices(torch.empty(0, dtype=torch.int64), IndexSpace.DEVICE_FULL)
    return Indices(torch.cat(parts), IndexSpace.DEVICE_FULL)


class TreeModel(RuleBasedStateMachine):
    page = 2
    policy = "write_through"
    device_pages = 8
    max_pages = 5
    ratio = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.service = make_service(self.page, self.policy, self.device_pages, ratio=self.ratio)
        self.tree = self.service.tree
        self.ctl = self.service.controller
        self.pool = self.service.device_pool
        self.host_pool = self.ctl.host_pool
        self.seqs: list[tuple[int, ...]] = [()]
        self.inserted: set[tuple[int, ...]] = set()  # whole-page prefixes ever inserted
        self.clock = 0
        self.last: dict[tuple[int, ...], int] = {}  # model LRU clock per page prefix
        self.locks: list[tuple[Any, tuple[int, ...], list[int]]] = []  # node, key, dev slots
        self.pending_loads: list[Any] = []  # node kept locked while a load is unstarted
        self.loads_unstarted = False
        self.view = self.observe()

    # ---- helpers -----------------------------------------------------------------
    def tokens(self, data) -> tuple[int, ...]:
        base = data.draw(st.sampled_from(self.seqs))
        cut = data.draw(st.integers(0, len(base)))
        extra = data.draw(st.lists(st.integers(0, 3), max_size=self.max_pages * self.page))
        toks = tuple(base[:cut]) + tuple(extra)
        return toks[: self.max_pages * self.page + self.page - 1]

    def whole(self, toks) -> tuple[int, ...]:
        return tuple(toks[: len(toks) // self.page * self.page])

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, key: tuple[int, ...], upto: int) -> None:
        now = self.tick()
        for end in range(self.page, upto + 1, self.page):
            self.last[key[:end]] = now

    def observe(self) -> dict:
        view = {}
        stack = [(self.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                toks = key_tokens(child.key)
                assert len(toks) % self.page == 0 and toks, f"bad key {toks}"
                dev = None if child.device is None else child.device.tensor.tolist()
                host = None if child.host is None else child.host.tensor.tolist()
                for i in range(0, len(toks), self.page):
                    p = prefix + toks[: i + self.page]
                    view[p] = dict(
                        dev=None if dev is None else tuple(dev[i:i + self.page]),
                        host=None if host is None else tuple(host[i:i + self.page]),
                        backed=child.is_backed_up, node=child, lock=child.lock_count,
                        loading=child.load_op is not None,
                        writing=child.write_op is not None or child.evict_on_ack,
                        eoa=child.evict_on_ack)
                stack.append((child, prefix + toks))
        return view

    def expected_match(self, key) -> tuple[int, int]:
        n = 0
        while n < len(key) and key[: n + self.page] in self.view:
            n += self.page
        d = 0
        while d < n and self.view[key[: d + self.page]]["dev"] is not None:
            d += self.page
        return d, n - d

    def children_pages(self, view, p):
        return [q for q in view if len(q) == len(p) + self.page and q[: len(p)] == p]

    def check_transitions(self, before, after, kind: str, key=None) -> None:
        page = self.page
        for p in after:
            if p not in before:
                assert kind == "request" and key is not None and p == key[: len(p)], \
                    f"{kind}: page {p} appeared"
                assert p in self.inserted, p
        removed = [p for p in before if p not in after]
        for p in removed:
            assert kind in ("request", "evict", "evict_host", "step", "load"), f"{kind} removed {p}"
            b = before[p]
            # removed: host-only leaf (host eviction) or never backed up (drop), or orphan
            dropped = b["dev"] is not None and not b["backed"]
            # below a never-backed-up page that was dropped (a page demoted to the host in
            # the same eviction goes with it: its parent has no KV anywhere)
            orphan = any(p[: k] in removed and before[p[:k]]["dev"] is not None
                         and not before[p[:k]]["backed"] for k in range(page, len(p), page))
            # write_back: a device page demoted in this call may leave the host again to make
            # room for the write-back of its parent (a host eviction inside the eviction)
            demoted = self.policy == "write_back" and b["backed"] and kind != "evict_host"
            assert b["dev"] is None or dropped or demoted or orphan, f"{kind}: page {p} removed " \
                f"while on device and backed up"
            assert dropped or orphan or b["host"] is not None, p
            assert b["lock"] == 0 or kind == "step", f"{kind}: locked page {p} removed"
        for p in after:
            if p not in before:
                continue
            b, a = before[p], after[p]
            if b["dev"] is not None and a["dev"] is None:
                assert kind in ("request", "evict", "step", "load"), f"{kind}: {p} left device"
                assert a["host"] is not None and a["backed"], f"{p} left device w/o backup"
            if b["dev"] is not None and a["dev"] is not None:
                assert b["dev"] == a["dev"], f"{kind}: {p} moved on device {b['dev']}->{a['dev']}"
            if b["host"] is not None and a["host"] is not None:
                assert b["host"] == a["host"], f"{kind}: {p} moved on host"
            if b["host"] is not None and a["host"] is None:
                raise AssertionError(f"{kind}: {p} lost its host copy but stayed")
            if b["dev"] is None and a["dev"] is not None:
                assert kind in ("request", "load"), f"{kind}: {p} came to device"
        # locked prefixes stay on the device at their slots
        for _, lkey, slots in self.locks:
            got = []
            for end in range(page, len(lkey) + 1, page):
                v = after.get(lkey[:end])
                assert v is not None and v["dev"] is not None, f"locked {lkey} lost page {end}"
                got += list(v["dev"])
            assert got == slots, f"locked {lkey} moved"

    def check_lru(self, before, after, tier: str) -> None:
        """Evicted pages are never more recent than evictable pages left behind."""
        if tier == "device":
            # a page already written back for eviction leaves at the ack whatever touched it
            # since, unless locked (documented): it is not chosen by this call
            gone = [p for p in before
                    if before[p]["dev"] is not None and not before[p]["eoa"]
                    and (p not in after or after[p]["dev"] is None
                         or (after[p]["eoa"] and not before[p]["eoa"]))]
            left = [p for p in after if after[p]["dev"] is not None and after[p]["lock"] == 0
                    and p in before and before[p]["lock"] == 0 and not before[p]["loading"]
                    and not before[p]["writing"]
                    and not after[p]["loading"] and not after[p]["writing"]
                    and not any(after[c]["dev"] is not None for c in self.children_pages(after, p))
                    and after[p]["node"].children.keys().__len__() >= 0]
            if self.policy == "write_back":  # a parent joins only once its child is written
                left = [p for p in left if p in before and not any(
                    before[c]["dev"] is not None for c in self.children_pages(before, p))]
            # a left page must be a node's last page to be a leaf
            left = [p for p in left if not any(q[: len(p)] == p and len(q) > len(p)
                                                and after[q]["node"] is after[p]["node"]
                                                for q in after)]
        else:
            gone = [p for p in before if p not in after and before[p]["dev"] is None]
            left = [p for p in after if after[p]["dev"] is None and after[p]["lock"] == 0
                    and p in before and before[p]["lock"] == 0
                    and not after[p]["loading"] and not self.children_pages(after, p)]
        if gone and left:
            g = max(self.last[p] for p in gone)
            lmin = min(self.last[p] for p in left)
            assert g <= lmin, (f"{tier} eviction not LRU: evicted "
                               f"{[(p, self.last[p]) for p in gone]} but kept "
                               f"{[(p, self.last[p]) for p in left]}")

    def check_rows(self) -> None:
        for p, v in self.view.items():
            rows = None
            if v["dev"] is not None and not (v["loading"] and self.loads_unstarted):
                rows = expected_rows(p, self.pool.num_layers)[-self.page:]
                got = read_rows(self.pool, torch.tensor(v["dev"]))
                assert torch.equal(got, rows), f"device rows of {p} wrong"
            if v["host"] is not None and v["backed"]:
                rows = expected_rows(p, self.pool.num_layers)[-self.page:]
                got = self.host_pool.read_rows(Indices(torch.tensor(v["host"]),
                                                       IndexSpace.HOST_FULL))
                assert torch.equal(got, rows), f"host rows of {p} wrong"

    def check_ownership(self) -> None:
        dev_alloc = self.ctl.device_allocator
        host_alloc = self.host_pool_allocator()
        seen_d, seen_h = {}, {}
        for p, v in self.view.items():
            for s in v["dev"] or ():
                assert s not in seen_d, f"device slot {s} owned by {seen_d[s]} and {p}"
                seen_d[s] = p
            for s in v["host"] or ():
                assert s not in seen_h, f"host slot {s} owned by {seen_h[s]} and {p}"
                seen_h[s] = p
        engine = set(self.service._engine.as_indices().tensor.tolist())
        assert not engine & set(seen_d), "engine and tree share a slot"
        used_d = set()
        for pg in dev_alloc.used_pages().tolist():
            used_d.update(range(pg * self.page, pg * self.page + self.page))
        assert used_d == set(seen_d) | engine, (
            f"device leak/overlap: used-not-owned {sorted(used_d - set(seen_d) - engine)}, "
            f"owned-not-used {sorted(set(seen_d) - used_d)}")
        used_h = set()
        for pg in host_alloc.used_pages().tolist():
            used_h.update(range(pg * self.page, pg * self.page + self.page))
        assert used_h == set(seen_h), (
            f"host leak/overlap: used-not-owned {sorted(used_h - set(seen_h))}, "
            f"owned-not-used {sorted(set(seen_h) - used_h)}")

    def host_pool_allocator(self):
        from hicache.pools import IndexSpace as S
        return self.tree.io.allocators()[S.HOST_FULL]

    def commit(self, kind: str, key=None) -> None:
        after = self.observe()
        self.check_transitions(self.view, after, kind, key)
        if kind in ("evict", "request", "load"):
            self.check_lru(self.view, after, "device")
        if kind == "evict_host":
            self.check_lru(self.view, after, "host")
        self.view = after
        for p in after:
            self.last.setdefault(p, 0)

    # ---- rules -------------------------------------------------------------------
    @rule(data=st.data(), dup=st.booleans(), lock_after=st.booleans())
    def request(self, data, dup, lock_after) -> None:
        toks = self.tokens(data)
        key = self.whole(toks)
        svc = self.service
        m = svc.match(list(toks))
        d, h = self.expected_match(key)
        assert (m.device_hit_tokens, m.host_hit_tokens) == (d, h), \
            f"match {key}: got {(m.device_hit_tokens, m.host_hit_tokens)} expected {(d, h)}"
        self.touch(key, d + h)
        self.commit("match")
        node = m.last_host_node
        svc.lock(node)
        prefix = [m.device_indices]
        if h:
            lb = svc.load_back(m, 10**6)
            if lb.queued:
                assert len(lb.device_indices) == h
                self.touch(key, d + h)  # the span's pages (ancestors already touched)
                prefix.append(lb.device_indices)
                svc.start_loading()
                self.loads_unstarted = False
            else:
                # the host run is not used: its pages are recomputed
                pass
        have = sum(len(x) for x in prefix)
        if dup:
            have, prefix = 0, []
        need = len(toks) - have
        new = svc.alloc_device(need) if need > 0 else cat([])
        if new is None:
            svc.release(node)
            self.commit("request", key)
            return
        write_rows(self.pool, new.tensor[: len(toks) - have],
                   expected_rows(toks, self.pool.num_layers)[have:])
        slots = cat([*prefix, new])
        self.inserted.update(key[:e] for e in range(self.page, len(key) + 1, self.page))
        svc.insert(list(toks), slots)
        self.touch(key, len(key))
        tail = slots.tensor[len(key):]
        if len(tail):
            svc.free_device(Indices(tail.clone(), IndexSpace.DEVICE_FULL))
        svc.release(node)
        if lock_after and key:
            m2 = svc.match(list(key))
            self.touch(key, len(key))
            assert m2.device_hit_tokens == len(key), "just inserted, not on device"
            svc.lock(m2.last_device_node)
            self.locks.append((m2.last_device_node, key, m2.device_indices.tensor.tolist()))
        if key not in self.seqs and len(self.seqs) < 30:
            self.seqs.append(tuple(toks))
        self.commit("request", key)

    @rule(data=st.data())
    def match(self, data) -> None:
        toks = self.tokens(data)
        key = self.whole(toks)
        m = self.service.match(list(toks))
        d, h = self.expected_match(key)
        assert (m.device_hit_tokens, m.host_hit_tokens) == (d, h), \
            f"match {key}: got {(m.device_hit_tokens, m.host_hit_tokens)} expected {(d, h)}"
        self.touch(key, d + h)
        self.commit("match")

    @rule(data=st.data())
    def load_unstarted(self, data) -> None:
        """A load-back queued but not issued: an in-flight load the tree must work around."""
        toks = self.tokens(data)
        key = self.whole(toks)
        m = self.service.match(list(toks))
        d, h = self.expected_match(key)
        assert (m.device_hit_tokens, m.host_hit_tokens) == (d, h)
        self.touch(key, d + h)
        self.commit("match")
        if not h:
            return
        lb = self.service.load_back(m, 10**6)
        if lb.queued:
            self.touch(key, d + h)
            self.loads_unstarted = True
        self.commit("load")

    @rule()
    def start_loading(self) -> None:
        self.service.start_loading()
        self.loads_unstarted = False
        self.commit("load")

    @rule(n=st.integers(0, 12))
    def evict(self, n) -> None:
        self.service.evict(n * self.page)
        self.commit("evict")

    @rule(n=st.integers(0, 12))
    def evict_host(self, n) -> None:
        self.service.evict_host(n * self.page)
        self.commit("evict_host")

    @rule()
    def step(self) -> None:
        if self.loads_unstarted:
            self.service.start_loading()
            self.loads_unstarted = False
        self.service.step()
        self.commit("step")

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def release(self, data) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(i)
        self.service.release(node)
        self.commit("release")

    def check_locks(self) -> None:
        """Exact lock counts: a node's count is the engine's locks and the locks of ops in
        flight held on it and its descendants, nothing more."""
        ops = {}
        for node in self.tree.nodes():
            for op in (node.write_op, node.load_op):
                if op is not None:
                    ops[id(op)] = op
        for op in self.tree.queued_backups:
            ops[id(op)] = op
        own = {}
        for op in ops.values():
            for n in op.locks:
                own[n] = own.get(n, 0) + 1

        def total(node):
            s = node.caller_locks + own.get(node, 0)
            for c in node.children.values():
                s += total(c)
            if node is not self.tree.root:
                assert node.lock_count == s, f"{node!r}: lock_count {node.lock_count} != {s}"
            return s
        total(self.tree.root)
        # the engine's own locks: exactly those the model holds
        held = {}
        for node, _, _ in self.locks:
            held[node] = held.get(node, 0) + 1
        for node in self.tree.nodes():
            assert node.caller_locks == held.get(node, 0), f"{node!r}: caller locks"

    @invariant()
    def consistent(self) -> None:
        self.check_locks()
        self.service.check_integrity()
        self.check_ownership()
        self.check_rows()

    def teardown(self) -> None:
        svc = self.service
        for node, _, _ in self.locks:
            svc.release(node)
        svc.start_loading()
        for _ in range(40):
            svc.step()
            svc.evict(10**6)
        svc.step()
        svc.evict_host(10**6)
        svc.step()
        svc.check_integrity()
        assert not list(self.tree.nodes()), "nodes left after evicting everything"
        for space, allocator in self.tree.io.allocators().items():
            assert allocator.num_free_tokens == allocator.capacity_tokens, f"{space} leaked"
        svc.stop()


def make(page: int, policy: str, ratio: float = 2.0):
    cls = type(f"M_{policy}_{page}_{ratio}", (TreeModel,),
               {"page": page, "policy": policy, "ratio": ratio})
    case = cls.TestCase
    case.settings = SETTINGS
    return case


TestWT1 = make(1, "write_through")
TestWT2 = make(2, "write_through")
TestWT16 = make(16, "write_through")
TestWTS2 = make(2, "write_through_selective")
TestWTS1 = make(1, "write_through_selective")
TestWB1 = make(1, "write_back")
TestWB2 = make(2, "write_back")
TestWB16 = make(16, "write_back")
TestWT1small = make(1, "write_through", 0.5)
TestWTS2small = make(2, "write_through_selective", 0.5)
TestWB1small = make(1, "write_back", 0.5)
TestWB2small = make(2, "write_back", 1.0)
TestWT16small = make(16, "write_through", 0.75)
