"""Loading configs/*.py the way `--config=` does (get_config() of the file), for the launch tests."""

import importlib.util
from pathlib import Path

import ml_collections

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def load(name: str) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(f"config_{Path(name).stem}", CONFIG_DIR / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
