import torch
class M(torch.nn.Module):
    def forward(self, input_ids, mask=None):
        return input_ids.float().sum(-1) + (0 if mask is None else mask.sum())
x = torch.zeros(2, 32, dtype=torch.long)
ep = torch.export.export(M(), (x,), {"mask": torch.ones(2,32)}, dynamic_shapes={"input_ids": {0: torch.export.Dim("batch", max=64)}, "mask": None})
print(ep.range_constraints)
for spec in ep.graph_signature.input_specs: print(spec.kind, spec.arg.name)
for n in ep.graph.nodes:
    if n.op == "placeholder": print(n.name, n.meta["val"].shape, [type(d) for d in n.meta["val"].shape])
print(ep.call_spec.in_spec)
try:
    ep.module()(torch.zeros(2, 48, dtype=torch.long), mask=torch.ones(2,48))
except Exception as e: print(type(e), e)
try:
    ep.module()(torch.zeros(100, 32, dtype=torch.long), mask=torch.ones(2,32))
except Exception as e: print(type(e), e)
