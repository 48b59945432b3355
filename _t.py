import time, torch
from fp4pass.fx.mxfp4 import MXFP4Experts
torch.manual_seed(0)
m = MXFP4Experts(32, 2880, 2880, routed=True)
for n in ("gate_up_proj", "down_proj"):
    b = getattr(m, n+"_blocks"); b.copy_(torch.randint(0,256,b.shape,dtype=torch.uint8))
    s = getattr(m, n+"_scales"); s.copy_(torch.randint(119,122,s.shape,dtype=torch.uint8))
x = torch.randn(64, 2880)
idx = torch.stack([torch.randperm(32)[:4] for _ in range(64)])
w = torch.softmax(torch.randn(64,4),-1)
for th in (1, 2):
    torch.set_num_threads(th)
    with torch.no_grad():
        for f in ("dense_forward", "routed_forward"):
            t=time.perf_counter(); getattr(m,f)(x, idx, w); print(th, f, round(time.perf_counter()-t,2), flush=True)
    from fp4pass.fx import dequant
    t=time.perf_counter(); dequant.dequantize_mxfp4(m.gate_up_proj_blocks.flatten(-2), m.gate_up_proj_scales); print(th, "dequant gate_up", round(time.perf_counter()-t,2))
    t=time.perf_counter(); torch.bmm(x.expand(32,-1,-1), torch.empty(32, 2880, 5760)); print(th, "bmm", round(time.perf_counter()-t,2))
