#!/usr/bin/env bash
# Sourced by the device scripts: the device cannot pip-install the checkout, so the engines would not find our
# entry points; write the package's dist-info (metadata + entry_points.txt from pyproject.toml) onto PYTHONPATH.
ep=/tmp/musa_attn_ep
python3 - "$ep" <<'PY'
import pathlib, sys, tomllib
proj = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
d = pathlib.Path(sys.argv[1]) / f"musa_attn_backend-{proj.get('version', '0.0.0')}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: musa-attn-backend\nVersion: {proj.get('version', '0.0.0')}\n")
lines = []
for group, eps in proj.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{k} = {v}" for k, v in eps.items()]
(d / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
export PYTHONPATH=$ep:$PYTHONPATH
