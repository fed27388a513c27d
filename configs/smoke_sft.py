"""The smoke run's supervised cold start (same model, task and meshes as configs/smoke.py).

python -m dora_jax.sft --config=configs/smoke_sft.py --workdir=/tmp/dora_sft
python -m dora_jax.train --config=configs/smoke.py --workdir=/tmp/dora_rl --config.init.checkpoint=/tmp/dora_sft/sft
"""

import importlib.util
import os


def get_config(arg=None):
    spec = importlib.util.spec_from_file_location("smoke", os.path.join(os.path.dirname(__file__), "smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    return smoke.get_config(arg)
