"""MkDocs hook: the plots in benchmarks/results/ become images of the site (docs/img/...).

The benchmarks write their plots beside their results; serving them from there keeps one copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).parent
    for plot in sorted((root / "benchmarks" / "results").glob("*.png")):
        files.append(File.generated(config, f"img/{plot.name}", abs_src_path=str(plot)))
    return files
