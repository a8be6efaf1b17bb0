"""Write the package metadata of the repository (no build step): `hybrid_rl-<version>.dist-info` in a
site-packages folder, beside the `.pth` file that puts the repository on the path.

vLLM finds the project's plugin through the entry point group `vllm.general_plugins`, and entry points
live in installed metadata; a `.pth` file alone has none.

    python scripts/write_dist_info.py SITE_PACKAGES
"""

import sys
import tomllib
from pathlib import Path


def entry_points(project: dict) -> str:
    """pyproject.toml's `[project.entry-points]` as an `entry_points.txt` (the same metadata `pip install .` writes)."""
    return "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n"
                   for group, points in project.get("entry-points", {}).items())


def main(site: Path) -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    for old in site.glob(f"{name}-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             "entry_points.txt": entry_points(project), "INSTALLER": "hybrid_rl-makefile\n"}
    for fname, text in files.items():
        (info / fname).write_text(text)
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in [*files, "RECORD"]))
    print(f"wrote {info}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
