import time, torch
import specdec.divergences as sd
from specdec.kernels import divergence as kdiv
n, v = 1024, 151936
g = torch.Generator(device="cuda").manual_seed(0)
ver = (torch.randn(n, v, device="cuda", generator=g) * 2).to(torch.bfloat16)
dra = (torch.randn(n, v, device="cuda", generator=g) * 2).to(torch.bfloat16)
grad = torch.empty_like(dra)
d_req = dra.clone().requires_grad_()
def host(fn, reps=200):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / reps * 1e6, (t2 - t0) / reps * 1e6
def fwd_bwd():
    d_req.grad = None
    sd.divergence_loss(d_req, ver, reduction="mean", check_inputs=False).backward()
def fwd_only():
    with torch.no_grad():
        sd.divergence_loss(dra, ver, reduction="mean", check_inputs=False)
def launch_only():
    kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad)
def rescale_only():
    kdiv.rescale_gradient(grad, torch.ones((), device="cuda"), torch.ones(1, device="cuda"))
def small_ops():
    ce = torch.empty(n, device="cuda")
    kdiv._weighted_total(ce, None, None) * 1.0
for name, fn in [("fwd+bwd", fwd_bwd), ("fwd (no grad)", fwd_only), ("launch_divergence", launch_only),
                 ("rescale_gradient", rescale_only), ("_weighted_total", small_ops)]:
    h, w = host(fn)
    print(f"{name:22s} host {h:8.1f} us/call   wall {w:8.1f} us/call")
