"""Every recipe in configs/ that fits this machine, run as shipped, against the figures its docs state.

    python -m benchmarks.recipes                                 # every recipe with fits_cpu: true, in turn
    python -m benchmarks.recipes --list                          # each recipe, whether it fits, its stated
                                                                 # figures; runs nothing
    python -m benchmarks.recipes --only embedded-tools.yaml --workdir /tmp/recipes

The stated figures are benchmarks/recipe_claims.yaml's (`--claims`): per file in configs/, the
metrics/eval.json key compared, the base and trained figures the docs state for its `dvc repro` and where they
say it, a tolerance (0.05: one run swings that much by seed) and optionally the least gain. A config with no
entry there is listed as "no stated figure" (`--only` runs it, to measure it).

Each recipe runs in `<workdir>/<stem>`, a fresh `git clone` of this repository's committed HEAD (a clone left
there by an earlier invocation is removed first), with what `make setup` installs and git does not track
linked in (`.venv` as a symlink, the GGUF files of `models/` copied), `configs/<name>` copied over
params.yaml, and `dvc repro` run with the venv's bin first on PATH, no telemetry, offline, and no tracking URI
or run ids inherited (the clone's own mlflow.db). Its output goes to `<workdir>/<stem>.log`. Then
metrics/eval.json's `base` and `trained` values of the metric are compared: each within the tolerance of the
stated figure, and their difference at least `min_gain`. A `dvc repro` that fails is a miss too, with the
tail of its log. Recipes run one after the other (each takes both cores).

Results (per recipe: stated, measured, wall seconds of `dvc repro`, the commit its clone ran, pass or miss
with the reasons) go to `--out` (default benchmarks/results/recipes.json, and the table beside it as
recipes.md), each written to a temp path then renamed. Exit status 1 when a recipe misses its figures, 2 on
bad input (an unknown `--only` name, a claims entry missing a key or naming a config that is not in configs/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CLAIMS = REPO / "benchmarks" / "recipe_claims.yaml"
RESULTS = REPO / "benchmarks" / "results" / "recipes.json"
REQUIRED_KEYS = ("config", "fits_cpu", "metric", "base", "trained", "source")
OPTIONAL_KEYS = ("why", "tolerance", "min_gain")
DEFAULT_TOLERANCE = 0.05
NO_FIGURE = "no stated figure"
# what a caller's environment must not hand the clone's stages (flows/pictures.py's tool_env drops the same)
INHERITED_VARS = ("MLFLOW_TRACKING_URI", "GRPO_PARENT_RUN_ID", "GRPO_FLOW_RUN_ID", "GRPO_RUN_GROUP",
                  "GRPO_EXPERIMENT_NAME", "GRPO_REPO_DIR", "DVC_ROOT", "DVC_STAGE", "PREFECT_API_URL")
QUIET_VARS = {"DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
              "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
LOG_TAIL_LINES = 40


class ClaimsError(ValueError):
    """Bad input: a claims entry, a config or an ``--only`` name; the message names what and where."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One entry of the claims file: what the docs state a recipe's ``dvc repro`` gives."""

    config: str
    fits_cpu: bool
    metric: str
    base: float | None
    trained: float | None
    source: str
    why: str | None = None
    tolerance: float = DEFAULT_TOLERANCE
    min_gain: float | None = None

    def stated(self) -> dict:
        """The stated figures as the results record them."""
        return {"metric": self.metric, "base": self.base, "trained": self.trained,
                "tolerance": self.tolerance, "min_gain": self.min_gain, "source": self.source}

    def has_figures(self) -> bool:
        return self.base is not None or self.trained is not None or self.min_gain is not None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A file of configs/ and its claim (None: no entry in the claims file)."""

    config: str
    claim: Claim | None

    @property
    def stem(self) -> str:
        return Path(self.config).stem

    def fits(self) -> bool | None:
        """Whether it runs on this machine; None when no entry says."""
        return None if self.claim is None else self.claim.fits_cpu


# ---------------------------------------------------------------------------------------------------
# The claims file


def _number(where: str, key: str, value: object, allow_none: bool) -> float | None:
    """``value`` as a float; ClaimsError naming ``where`` and ``key`` when it is not a number."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "a number or null" if allow_none else "a number"
        raise ClaimsError(f"{where}: {key!r} must be {kind}, got {value!r}")
    return float(value)


def _source_file(source: str) -> str:
    """The file a ``source`` string cites: its first word, without a trailing comma or colon."""
    return source.split()[0].rstrip(",:;") if source.split() else ""


def parse_claim(entry: object, where: str, configs_dir: Path, root: Path) -> Claim:
    """One entry of the claims file, checked: every key present and typed, the config in ``configs_dir``, the
    source file under ``root``. ``where`` names the entry in errors."""
    if not isinstance(entry, dict):
        raise ClaimsError(f"{where}: an entry must be a mapping, got {entry!r}")
    where = f"{where} ({entry['config']})" if isinstance(entry.get("config"), str) else where
    missing = [k for k in REQUIRED_KEYS if k not in entry]
    unknown = sorted(set(entry) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise ClaimsError(f"{where}: " + "; ".join(
            ([f"missing key(s) {', '.join(map(repr, missing))}"] if missing else [])
            + ([f"unknown key(s) {', '.join(map(repr, unknown))}"] if unknown else [])))
    if not isinstance(entry["config"], str) or not (configs_dir / entry["config"]).is_file():
        raise ClaimsError(f"{where}: 'config' names {entry['config']!r}, "
                          f"which is not a file in {configs_dir}")
    if not isinstance(entry["fits_cpu"], bool):
        raise ClaimsError(f"{where}: 'fits_cpu' must be true or false, got {entry['fits_cpu']!r}")
    if not entry["fits_cpu"] and not entry.get("why"):
        raise ClaimsError(f"{where}: 'why' is required when fits_cpu is false")
    for key in ("metric", "source"):
        if not isinstance(entry[key], str) or not entry[key].strip():
            raise ClaimsError(f"{where}: {key!r} must be a non-empty string, got {entry[key]!r}")
    if not (root / _source_file(entry["source"])).is_file():
        raise ClaimsError(f"{where}: 'source' must start with the file that states the figures; "
                          f"{_source_file(entry['source'])!r} is not a file under {root}")
    tolerance = _number(where, "tolerance", entry.get("tolerance", DEFAULT_TOLERANCE), allow_none=False)
    if tolerance < 0:
        raise ClaimsError(f"{where}: 'tolerance' must be at least 0, got {tolerance}")
    return Claim(config=entry["config"], fits_cpu=entry["fits_cpu"], metric=entry["metric"],
                 base=_number(where, "base", entry["base"], allow_none=True),
                 trained=_number(where, "trained", entry["trained"], allow_none=True),
                 source=entry["source"], why=entry.get("why"), tolerance=tolerance,
                 min_gain=_number(where, "min_gain", entry.get("min_gain"), allow_none=True))


def load_claims(path: Path, configs_dir: Path, root: Path = REPO) -> dict[str, Claim]:
    """The claims file's entries by config name; ClaimsError naming the file and entry on bad input."""
    if not path.is_file():
        raise ClaimsError(f"{path}: no such claims file")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ClaimsError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("recipes"), list):
        raise ClaimsError(f"{path}: expected a mapping with a 'recipes' list")
    claims: dict[str, Claim] = {}
    for i, entry in enumerate(doc["recipes"]):
        claim = parse_claim(entry, f"{path}: recipes[{i}]", configs_dir, root)
        if claim.config in claims:
            raise ClaimsError(f"{path}: recipes[{i}] ({claim.config}): a second entry for this config")
        claims[claim.config] = claim
    return claims


def recipes(claims: dict[str, Claim], configs_dir: Path) -> list[Recipe]:
    """Every .yaml file in ``configs_dir``, in name order, with its claim or None."""
    names = sorted(p.name for p in configs_dir.glob("*.yaml") if p.is_file())
    return [Recipe(name, claims.get(name)) for name in names]


def select(all_recipes: list[Recipe], only: list[str] | None) -> list[Recipe]:
    """The recipes ``only`` names (a file name or its stem), or every one; ClaimsError for an unknown name."""
    if not only:
        return all_recipes
    by_name = {r.config: r for r in all_recipes} | {r.stem: r for r in all_recipes}
    unknown = [name for name in only if name not in by_name]
    if unknown:
        raise ClaimsError(f"--only: no recipe {', '.join(map(repr, unknown))} in configs/ "
                          f"(there are: {', '.join(r.config for r in all_recipes)})")
    return list({by_name[name].config: by_name[name] for name in only}.values())


# ---------------------------------------------------------------------------------------------------
# Comparing a run with its claim


def _miss(name: str, measured: float, stated: float, tolerance: float) -> str | None:
    """Why ``measured`` is not within ``tolerance`` of ``stated`` (None when it is)."""
    off = measured - stated
    if abs(off) <= tolerance + 1e-9:
        return None
    return f"{name} {measured:.3f}, stated {stated:.3f}: off by {off:+.3f} (tolerance {tolerance:g})"


def compare(claim: Claim, eval_doc: dict) -> dict:
    """metrics/eval.json's ``base`` and ``trained`` values of the claim's metric against its stated figures:
    ``{"measured": {base, trained, gain}, "passed": bool, "reasons": [...]}``, a reason per figure missed."""
    values = {side: (eval_doc.get(side) or {}).get(claim.metric) for side in ("base", "trained")}
    absent = [side for side, v in values.items() if not isinstance(v, int | float)]
    if absent:
        return {"measured": values, "passed": False,
                "reasons": [f"metrics/eval.json has no {side}.{claim.metric}" for side in absent]}
    base, trained = float(values["base"]), float(values["trained"])
    reasons = [r for r in (
        None if claim.trained is None else _miss(f"trained {claim.metric}", trained, claim.trained,
                                                  claim.tolerance),
        None if claim.base is None else _miss(f"base {claim.metric}", base, claim.base, claim.tolerance),
    ) if r]
    if claim.min_gain is not None and trained - base < claim.min_gain - 1e-9:
        reasons.append(f"gain {trained - base:+.3f}, stated at least {claim.min_gain:+.3f}: "
                       f"short by {claim.min_gain - (trained - base):.3f}")
    return {"measured": {"base": base, "trained": trained, "gain": round(trained - base, 6)},
            "passed": not reasons, "reasons": reasons}


# ---------------------------------------------------------------------------------------------------
# Running a recipe


def recipe_env(clone: Path) -> dict[str, str]:
    """The environment of ``dvc repro`` in ``clone``: the venv's bin first on PATH (dvc.yaml's ``python``
    is the project's), the clone's code first on the import path, no telemetry, offline, nothing inherited
    that would point the stages elsewhere."""
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_VARS}
    env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(clone)
    return {**env, **QUIET_VARS}


def make_clone(recipe: Recipe, workdir: Path, repo: Path = REPO) -> Path:
    """A fresh clone of ``repo``'s HEAD at ``workdir/<stem>`` with ``.venv`` linked, the GGUF files of
    ``models/`` copied and the recipe as params.yaml; ClaimsError when the recipe is not in the committed
    HEAD."""
    clone = workdir / recipe.stem
    if clone.exists():
        shutil.rmtree(clone)
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "--quiet", str(repo), str(clone)], check=True)
    (clone / ".venv").symlink_to((repo / ".venv").resolve(), target_is_directory=True)
    for gguf in sorted((repo / "models").glob("*.gguf")):
        (clone / "models").mkdir(exist_ok=True)
        shutil.copyfile(gguf, clone / "models" / gguf.name)
    config = clone / "configs" / recipe.config
    if not config.is_file():
        raise ClaimsError(f"configs/{recipe.config} is not in the committed HEAD "
                          "(commit it to run it as shipped)")
    shutil.copyfile(config, clone / "params.yaml")
    return clone


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log`` (empty when it is missing)."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


def run_recipe(recipe: Recipe, workdir: Path) -> dict:
    """``dvc repro`` of one recipe in a fresh clone, timed, and its result against the recipe's claim."""
    log = workdir / f"{recipe.stem}.log"
    record = {"config": recipe.config, "stated": recipe.claim.stated() if recipe.claim else None,
              "log": str(log)}
    try:
        clone = make_clone(recipe, workdir)
    except (ClaimsError, subprocess.CalledProcessError, OSError) as exc:
        return {**record, "status": "miss", "wall_s": None, "measured": None, "reasons": [str(exc)]}
    record["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True,
                                      text=True).stdout.strip() or None  # what this recipe ran: HEAD moves on
    print(f"recipes: dvc repro of {recipe.config} in {clone} (log: {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([str(clone / ".venv" / "bin" / "dvc"), "repro"], cwd=clone,
                              env=recipe_env(clone), stdout=out, stderr=subprocess.STDOUT)
    record["wall_s"] = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        return {**record, "status": "miss", "measured": None, "log_tail": log_tail(log),
                "reasons": [f"dvc repro exited {proc.returncode}"]}
    eval_json = clone / "metrics" / "eval.json"
    if not eval_json.is_file():
        return {**record, "status": "miss", "measured": None, "reasons": ["no metrics/eval.json"]}
    eval_doc = json.loads(eval_json.read_text())
    if recipe.claim is None or not recipe.claim.has_figures():
        sides = {side: (eval_doc.get(side) or {}) for side in ("base", "trained")}
        metric = recipe.claim.metric if recipe.claim else "accuracy"
        return {**record, "status": NO_FIGURE, "reasons": [],
                "measured": {side: values.get(metric) for side, values in sides.items()}}
    verdict = compare(recipe.claim, eval_doc)
    return {**record, "status": "pass" if verdict["passed"] else "miss", "measured": verdict["measured"],
            "reasons": verdict["reasons"]}


def not_run(recipe: Recipe) -> dict:
    """The record of a recipe this invocation does not run: one that does not fit, or has no entry."""
    if recipe.claim is None:
        return {"config": recipe.config, "status": NO_FIGURE, "stated": None, "measured": None,
                "wall_s": None, "reasons": ["no entry in the claims file"]}
    return {"config": recipe.config, "status": "does not fit", "stated": recipe.claim.stated(),
            "measured": None, "wall_s": None, "reasons": [recipe.claim.why or ""]}


# ---------------------------------------------------------------------------------------------------
# Reporting


def _figure(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def describe(recipe: Recipe) -> str:
    """One line of ``--list``: the recipe, whether it fits, its stated figures."""
    claim = recipe.claim
    if claim is None:
        return f"{recipe.config}: {NO_FIGURE} (no entry in the claims file)"
    fits = "fits this machine" if claim.fits_cpu else f"does not fit ({claim.why})"
    if not claim.has_figures():
        return f"{recipe.config}: {fits}; {NO_FIGURE}"
    gain = f", gain >= {claim.min_gain:g}" if claim.min_gain is not None else ""
    return (f"{recipe.config}: {fits}; {claim.metric} {_figure(claim.base)} -> {_figure(claim.trained)} "
            f"(± {claim.tolerance:g}{gain}); source: {claim.source}")


def markdown(records: list[dict]) -> str:
    """The results as a markdown table, a row per recipe."""
    rows = ["| recipe | stated base -> trained (± tol; least gain) | measured base -> trained (gain) "
            "| dvc repro | result |", "| --- | --- | --- | --- | --- |"]
    for r in records:
        s, m = r.get("stated") or {}, r.get("measured") or {}
        stated = (f"{_figure(s.get('base'))} -> {_figure(s.get('trained'))} (± {s.get('tolerance'):g}"
                  + (f"; {s['min_gain']:+g}" if s.get("min_gain") is not None else "") + ")") if s else "–"
        gain = m.get("gain")
        measured = (f"{_figure(m.get('base'))} -> {_figure(m.get('trained'))}"
                    + (f" ({gain:+.3f})" if gain is not None else "")) if m else "–"
        wall = f"{r['wall_s'] / 60:.1f} min" if r.get("wall_s") is not None else "–"
        result = r["status"] + (": " + "; ".join(r["reasons"]) if r["reasons"] else "")
        rows.append(f"| `{r['config']}` | {stated} | {measured} | {wall} | {result} |")
    return "\n".join(rows) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """``text`` to a temp path beside ``path``, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_results(records: list[dict], out: Path, argv: list[str]) -> None:
    """The JSON (``out`` with .json) and the markdown table (with .md)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    doc = {"command": " ".join(["python -m benchmarks.recipes", *argv]), "commit": commit,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
           "cores": os.cpu_count(), "recipes": records}
    write_atomic(out.with_suffix(".json"), json.dumps(doc, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), markdown(records))


def summary(records: list[dict]) -> tuple[str, int]:
    """A line per recipe for stdout, and the exit status: 1 when any recipe missed its figures."""
    lines = [f"{r['status'].upper():<16} {r['config']}" + "".join(f"\n    {why}" for why in r["reasons"])
             for r in records]
    for r in records:
        if r.get("log_tail"):
            lines.append(f"--- the end of {r['config']}'s log ({r['log']}):\n{r['log_tail']}")
    missed = [r["config"] for r in records if r["status"] == "miss"]
    if missed:
        lines.append(f"missed their stated figures: {', '.join(missed)}")
    return "\n".join(lines), 1 if missed else 0


# ---------------------------------------------------------------------------------------------------


def run_selected(selected: list[Recipe], named: bool, workdir: Path) -> list[dict]:
    """Run what fits (and, named by ``--only``, what has no entry); record the others as not run. ClaimsError,
    before anything runs, when ``--only`` names a recipe that does not fit this machine."""
    unfit = [r for r in selected if named and r.fits() is False]
    if unfit:
        raise ClaimsError("--only: " + "; ".join(f"{r.config} does not fit this machine ({r.claim.why})"
                                                 for r in unfit))
    return [run_recipe(r, workdir) if r.fits() or (named and r.claim is None) else not_run(r)
            for r in selected]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recipes", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="these recipes only (file names in configs/, or their stems)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/grpo-recipes"),
                        help="where each recipe's clone and log go (a clone left there is replaced)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the JSON; the markdown table goes beside it with .md")
    parser.add_argument("--list", action="store_true",
                        help="print each recipe, whether it fits, its stated figures; run nothing")
    parser.add_argument("--claims", type=Path, default=CLAIMS, help="the stated figures (YAML)")
    a = parser.parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    try:
        selected = select(recipes(load_claims(a.claims, REPO / "configs"), REPO / "configs"), a.only)
        if a.list:
            print("\n".join(describe(r) for r in selected))
            return 0
        if not (REPO / ".venv" / "bin" / "dvc").is_file():
            raise ClaimsError(f"{REPO / '.venv' / 'bin' / 'dvc'} is missing: run `make setup` first")
        records = run_selected(selected, bool(a.only), a.workdir.resolve())
    except ClaimsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_results(records, a.out, argv)
    text, status = summary(records)
    print(text)
    print(f"results: {a.out.with_suffix('.json')}, {a.out.with_suffix('.md')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
