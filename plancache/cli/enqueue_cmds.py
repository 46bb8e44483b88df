"""``plancache enqueue``: register spec files or capture files on a server and queue tuning jobs for them (admin),
optionally the variants of each graph along shape axes (``--vary``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .common import (
    GIVE_ADMIN_TOKEN,
    ExitCode,
    Failure,
    admin_token_option,
    command,
    load_spec_file,
    open_admin_api,
    quiet_retries,
    read_spec_file,
    server_option,
)

if TYPE_CHECKING:
    from ..spec import GraphSpec



@command
def enqueue(
    files: list[Path] = typer.Argument(..., help="GraphSpec JSON files, or capture files (plancache capture)"),
    server: str | None = server_option("plancache server URL"),
    token: str | None = admin_token_option(),
    sm: int | None = typer.Option(None, "--sm", help="compute capability major*10+minor, e.g. 90 (default: any)"),
    sm_count: int | None = typer.Option(None, "--sm-count", help="number of SMs, e.g. 132 (default: any)"),
    cudnn_version: int | None = typer.Option(None, "--cudnn-version", help="e.g. 91900 (default: any)"),
    driver_version: int | None = typer.Option(None, "--driver-version", help="e.g. 13000 (default: any)"),
    frontend_version: str | None = typer.Option(None, "--frontend-version", help="e.g. 1.32.0 (default: any)"),
    priority: int = typer.Option(0, "--priority", help="higher is claimed first"),
    wait: float = typer.Option(5.0, "--wait", min=0.0,
                               help="seconds to keep trying an unreachable or failing server before giving up"),
    vary: list[str] = typer.Option([], "--vary", metavar="AXIS=SIZES",
                                   help="enqueue each graph at these sizes of a shape axis instead, e.g. s=128,256,512 "
                                        "(axes: b, s_q, s_kv, s = s_q and s_kv; docs/CLI.md); repeat for several"),
) -> None:
    """Register spec files (or every graph of capture files) on the server and queue a tuning job for each on the
    given target (a field left out matches any environment). Jobs of capture files carry the source `capture`."""
    from pydantic import ValidationError

    from ..client.remote import Remote
    from ..errors import Forbidden, Unauthorized
    from ..protocol import MAX_KEYS_PER_REQUEST, PRIORITY_MAX, TargetEnvironment, TuneRequest

    if abs(priority) > PRIORITY_MAX:  # before any spec is registered
        raise Failure(f"--priority {priority}: a priority is between -{PRIORITY_MAX} and {PRIORITY_MAX}",
                      "see `plancache enqueue --help`", ExitCode.USAGE)
    specs = [item for p in files for item in _load(p)]
    if vary:
        specs = _variants(specs, _parse_vary(vary))
    try:
        target = TargetEnvironment(sm=sm, sm_count=sm_count, cudnn_version=cudnn_version, driver_version=driver_version,
                                   frontend_version=frontend_version)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "--" + str(first["loc"][0]).replace("_", "-") if first.get("loc") else "the target"
        raise Failure(f"{field}: {first['msg']}", "see `plancache enqueue --help`", ExitCode.USAGE) from None
    api = open_admin_api(server, token, "enqueue", server_use="to send the jobs to", within=wait)
    try:
        with quiet_retries(), api:
            for name, spec, _ in specs:
                key = Remote(api.http).register_spec(spec)
                if key != spec.graph_key:
                    raise Failure(f"{name}: the server computed graph key {key}, this client {spec.graph_key}",
                                  "use the same plancache version on both sides", ExitCode.FAILED)
            jobs = []
            for source in ("admin", "capture"):
                keys = list(dict.fromkeys(s.graph_key for _, s, captured in specs if captured == (source == "capture")))
                for start in range(0, len(keys), MAX_KEYS_PER_REQUEST):  # a request takes this many keys at most
                    jobs += api.enqueue(TuneRequest(graph_keys=keys[start:start + MAX_KEYS_PER_REQUEST],
                                                    targets=[target], priority=priority, source=source))
    except (Unauthorized, Forbidden) as exc:
        raise Failure(f"{exc.message} (enqueue needs an admin token)", GIVE_ADMIN_TOKEN, ExitCode.AUTH) from None
    names = {s.graph_key: name for name, s, _ in specs}
    for job in jobs:
        typer.echo(f"job {job.id}  {job.status:<9} {job.graph_key[:12]}  {names.get(job.graph_key, '')}")


def _load(path: Path) -> list[tuple[str, GraphSpec, bool]]:
    """(name shown, spec, from a capture file) for each graph of a spec file or a capture file."""
    from ..client.capture import MAX_CAPTURE_BYTES, is_capture, load_json, parse_capture, starts_as_capture
    from ..errors import SpecError

    data = read_spec_file(path, MAX_CAPTURE_BYTES, "spec or capture file")
    try:
        doc = load_json(path, data)
    except SpecError as exc:
        if starts_as_capture(data):  # cut off
            raise Failure(exc.message, None, ExitCode.FAILED) from None
        doc = None  # load_spec_file names the problem
    if not is_capture(doc):
        return [(path.name, load_spec_file(path, data), False)]
    try:
        graphs = parse_capture(doc)
    except SpecError as exc:
        raise Failure(f"{path}: {exc.message}", "capture the program again (plancache capture)", ExitCode.FAILED) from None
    return [(f"{path.name}:{spec.name or 'graph'} (built {count}x)", spec, True) for spec, count in graphs]


def _parse_vary(values: list[str]) -> dict[str, list[int]]:
    from ..client.capture import setters
    from ..protocol import MAX_KEYS_PER_REQUEST

    axes: dict[str, list[int]] = {}
    for value in values:
        name, _, sizes = value.partition("=")
        try:
            numbers = [int(v) for v in sizes.split(",")]
        except ValueError:
            numbers = []
        if not name or not numbers or any(n < 1 for n in numbers) or name in axes:
            raise Failure(f"--vary {value!r}: expected AXIS=SIZES with positive integer sizes, each axis once",
                          "e.g. --vary s=128,256,512 --vary b=1,8", ExitCode.USAGE)
        axes[name] = list(dict.fromkeys(numbers))
    twice = sorted(part for part, by in setters(axes).items() if len(by) > 1)
    if twice:  # s and s_q: one would override the other in every variant, whatever its label says
        raise Failure(f"--vary {', '.join(axes)}: {', '.join(twice)} given twice (s is s_q and s_kv together)",
                      "give s, or s_q and s_kv", ExitCode.USAGE)
    combinations = math.prod(len(sizes) for sizes in axes.values())
    if combinations > MAX_KEYS_PER_REQUEST:
        raise Failure(f"--vary: {combinations} combinations of sizes per graph; the limit is {MAX_KEYS_PER_REQUEST}",
                      "give fewer sizes, or enqueue in several runs", ExitCode.USAGE)
    return axes


def _variants(specs: list[tuple[str, GraphSpec, bool]], axes: dict[str, list[int]]) -> list[tuple[str, GraphSpec, bool]]:
    """Every graph that has each axis, at every combination of the sizes; the others are skipped (said on stderr)."""
    from ..client.capture import axes_of, variants
    from ..errors import SpecError

    out, skipped = [], []
    for name, spec, captured in specs:
        missing = [a for a in axes if a not in axes_of(spec)]
        if missing:
            skipped.append(f"skipped {name}: no axis {', '.join(missing)} (it has {', '.join(axes_of(spec)) or 'none'})")
            continue
        try:
            varied = variants(spec, axes)
        except SpecError as exc:
            raise Failure(f"{name}: {exc.message}", "vary moves plain attention graphs (docs/CLI.md, "
                          "\"enqueue --vary\")", ExitCode.FAILED) from None
        for chosen, variant in varied:
            label = ",".join(f"{a}={n}" for a, n in chosen.items())
            out.append((f"{name} [{label}]", variant, captured))
    if not out:
        raise Failure(f"no graph has the axes {', '.join(axes)} to vary",
                      "vary moves SDPA forward and backward graphs along b, s_q, s_kv and s (docs/CLI.md)",
                      ExitCode.USAGE)
    for line in skipped:
        typer.echo(line, err=True)
    return out


def register(app: typer.Typer) -> None:
    app.command("enqueue")(enqueue)
