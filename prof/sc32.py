import time, torch, cProfile, pstats, sys, numpy as np
from hicache.controller import CacheController, make_backend
from hicache.pools import DeviceKVPool, HostKVPool, PageAllocator, IndexSpace, Indices, RowGeometry, AttentionKind, HostLayout
geo = RowGeometry(AttentionKind.MHA, 8, 128, 0, torch.bfloat16)
P=16; L=32; N=32768
layout = HostLayout(sys.argv[2]) if len(sys.argv)>2 else HostLayout.LAYER_FIRST
for name in sys.argv[1].split(","):
    pages = 2*N//P+9
    alloc = PageAllocator(pages, P, IndexSpace.DEVICE_FULL, "full")
    dev = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=L, num_slots=alloc.num_slots, geometry=geo, device="cuda")
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=L, num_pages=N//P+8, page_size=P, geometry=geo, layout=layout)
    ctrl = CacheController(device_pool=dev, device_allocator=alloc, host_pool=host, backend=make_backend(name, torch.device("cuda")))
    # fragment the device pool: every other page taken
    every = alloc.try_alloc((pages-1)*P)
    keep = Indices(every.tensor.view(-1, 2*P)[:, :P].reshape(-1), IndexSpace.DEVICE_FULL)
    alloc.free(Indices(every.tensor.view(-1, 2*P)[:, P:].reshape(-1), IndexSpace.DEVICE_FULL))
    d = alloc.try_alloc(N); h = ctrl.write(d); ctrl.drain(); ctrl.evict_device(d)
    def one():
        torch.cuda.synchronize()
        t0=time.perf_counter(); got = ctrl.load(h); t1=time.perf_counter(); ctrl.start_loading(); t2=time.perf_counter()
        ctrl.drain(); ctrl.evict_device(got); return t1-t0, t2-t1
    for _ in range(3): one()
    r=[one() for _ in range(11)]
    a=sorted(x[0] for x in r); b=sorted(x[1] for x in r)
    print(name, layout.value, N, "load() ms %.3f start_loading ms %.3f" % (a[5]*1e3, b[5]*1e3), dict(ctrl.stats.backend_ops), flush=True)
    got=ctrl.load(h)
    pr=cProfile.Profile(); pr.enable(); ctrl.start_loading(); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    ctrl.drain()
    del ctrl, dev, host; torch.cuda.empty_cache()
