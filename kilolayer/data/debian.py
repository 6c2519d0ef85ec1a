"""Debian packages as data: extract them into a folder without installing, and record their versions.

``python -m kilolayer.data.debian fetch de_en fr_en lo_help lo_multi:en,de,ja [--root DIR]`` runs ``apt-get
download`` for the packages the ``de_en``/``fr_en`` sources (:mod:`kilolayer.data.parallel`), the ``lo_help`` source
(:mod:`kilolayer.data.lo_help`) and the ``lo_multi`` source (:mod:`kilolayer.data.lo_multi`: the help of the
languages after the colon, English's included, and their UI catalogues; ``lo_multi`` alone: all 34) read,
``dpkg -x`` each into ``DIR`` (default ``$KILOLAYER_PARALLEL_ROOT``, else ``$KILOLAYER_CACHE/parallel/root``) and
records each package's version in ``DIR/kilolayer-packages.json`` (:mod:`kilolayer.data.packages` reads it). No root
rights and no system install are needed; a package already recorded with its files present is not fetched again.
``python -m kilolayer.data.debian sizes CONFIG`` prints a ``lo_multi`` config's corpus sizes per language and
direction.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kilolayer.data import lo_help, lo_multi, parallel
from kilolayer.data.packages import MANIFEST, read_manifest


def fetch_packages(wanted: dict[str, str], root: Path) -> dict[str, str]:
    """``apt-get download`` the packages of ``wanted`` (package -> a path under ``root`` its files include) and
    ``dpkg -x`` them into ``root``; those already recorded with that path present are skipped. Returns package ->
    version."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(root)
    todo = sorted(p for p, marker in wanted.items() if p not in manifest or not (root / marker).exists())
    if todo:
        with tempfile.TemporaryDirectory(dir=root.parent) as debs:
            subprocess.run(["apt-get", "download", "-qq", *todo], cwd=debs, check=True)
            for deb in sorted(Path(debs).glob("*.deb")):
                fields = subprocess.run(
                    ["dpkg-deb", "-f", str(deb), "Package", "Version"], capture_output=True, text=True, check=True
                ).stdout
                info = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
                subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
                manifest[info["Package"]] = info["Version"]
        (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {p: manifest.get(p, "unknown") for p in sorted(wanted)}


def fetchable() -> dict[str, dict[str, str]]:
    """Source name -> the packages it reads, each with a path (under the root) that shows it is there."""
    return {
        **{name: parallel.all_packages(name) for name in sorted(parallel.PAIRS)},
        "lo_help": lo_help.PACKAGES,
        lo_multi.NAME: lo_multi.packages(lo_multi.LANGUAGES),
    }


def packages_of(name: str, sources: dict[str, dict[str, str]]) -> dict[str, str] | str:
    """The packages a fetch argument names (a source, or ``lo_multi:LANG,LANG,...``), or why it names none."""
    base, _, langs = name.partition(":")
    if base == lo_multi.NAME and langs:
        bad = [lang for lang in langs.split(",") if lang not in lo_multi.LANGUAGES]
        if bad:
            return f"unknown language {', '.join(bad)} in {name}; allowed: {', '.join(lo_multi.LANGUAGES)}"
        return lo_multi.packages(langs.split(","))
    if name not in sources:
        return f"unknown {name}; allowed: {', '.join(sources)} ({lo_multi.NAME}:LANG,LANG,... for some languages)"
    return sources[name]


def sizes(config_path: str, sets: list[str], as_json: bool) -> int:
    """Print the corpus sizes of a ``lo_multi`` config: texts per language, pairs per direction (built and cached
    as a run would build them)."""
    from kilolayer.config import load_config
    from kilolayer.errors import ConfigError, KilolayerError

    try:
        config = load_config(config_path, sets)
        if config.data.name != lo_multi.NAME:
            raise ConfigError(f"data.name={config.data.name!r}: sizes reads a {lo_multi.NAME!r} config")
        record = lo_multi.make_source(config).record
    except KilolayerError as err:
        print(f"kilolayer: error: {err}", file=sys.stderr)
        return err.exit_code
    print(json.dumps(record, indent=2, sort_keys=True) if as_json else lo_multi.sizes_table(record))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kilolayer.data.debian", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download and extract the packages of Debian-package sources (no system install)")
    sources = fetchable()
    f.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"{' '.join(sources)} or {lo_multi.NAME}:LANG,... (default: all but {lo_multi.NAME})",
    )
    f.add_argument("--root", default=None, help=f"default: ${parallel.ENV_ROOT}, else {parallel.default_root()}")
    z = sub.add_parser("sizes", help=f"print the corpus sizes of a {lo_multi.NAME} config (per language and direction)")
    z.add_argument("config", help=f"a config whose data.name is {lo_multi.NAME}")
    z.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    z.add_argument("--json", action="store_true", help="every count of the source's record, as JSON")
    args = ap.parse_args(argv)
    if args.command == "sizes":
        return sizes(args.config, args.set, args.json)
    root = Path(args.root) if args.root else parallel.resolve_root(None)
    wanted = {}
    for name in args.names or [n for n in sources if n != lo_multi.NAME]:
        found = packages_of(name, sources)
        if isinstance(found, str):
            ap.error(found)
        wanted.update(found)
    try:
        versions = fetch_packages(wanted, root)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"kilolayer: error: fetching {' '.join(sorted(wanted))} into {root} failed: {err}", file=sys.stderr)
        return 1
    print(f"{root}: " + ", ".join(f"{p} {v}" for p, v in versions.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
