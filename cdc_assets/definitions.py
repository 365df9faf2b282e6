"""The root ``Definitions`` of the project, built from the configuration file named by ``CDC_CONFIG``
(default: ``cdc.yaml`` at the repository root)."""

import os
from pathlib import Path

from cdc_assets.build import build_definitions

ROOT = Path(__file__).resolve().parents[1]

defs = build_definitions(os.environ.get("CDC_CONFIG", str(ROOT / "cdc.yaml")))
