import sys
from safetensors.torch import load_file
import glob
a = {}
for f in glob.glob(sys.argv[1] + "/*.safetensors"): a.update(load_file(f))
b = {}
for f in glob.glob(sys.argv[2] + "/*.safetensors"): b.update(load_file(f))
common = sorted(set(a) & set(b))
diff = n = 0; mx = 0.0
for k in common:
    d = (a[k].float() - b[k].float()).abs()
    diff += int((d != 0).sum()); n += d.numel(); mx = max(mx, float(d.max()))
print(f"original: {sys.argv[1]}\nreplay:   {sys.argv[2]}\ntensors: {len(common)} (dtype {a[common[0]].dtype}), elements {n}, differing {diff}, max |delta| {mx}")
