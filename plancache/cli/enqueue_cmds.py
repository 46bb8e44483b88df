"""``plancache enqueue``: register spec files or capture files on a server and queue tuning jobs for them (admin),
optionally the variants of each graph along shape axes (``--vary``).

Specs are registered and their keys queued as they come, :data:`~plancache.protocol.MAX_KEYS_PER_REQUEST` keys per
tune request: the variants of ``--vary`` are built one at a time, so memory holds one request's keys whatever their
number (the limits allow 100,000 graphs × 10,000 sizes), with a progress bar on stderr and a final count."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer

from .failures import ExitCode, Failure, command
from .inputs import load_spec_file, read_spec_file
from .options import admin_token_option, server_option
from .server_api import GIVE_ADMIN_TOKEN, open_admin_api, quiet_retries

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
    stream: Iterator[tuple[str, GraphSpec, bool]] = iter(specs)
    total = len(specs)
    if vary:
        stream, total = _variants(specs, _parse_vary(vary))
    try:
        target = TargetEnvironment(sm=sm, sm_count=sm_count, cudnn_version=cudnn_version, driver_version=driver_version,
                                   frontend_version=frontend_version)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "--" + str(first["loc"][0]).replace("_", "-") if first.get("loc") else "the target"
        raise Failure(f"{field}: {first['msg']}", "see `plancache enqueue --help`", ExitCode.USAGE) from None
    api = open_admin_api(server, token, "enqueue", server_use="to send the jobs to", within=wait)
    pending: dict[Literal["admin", "capture"], dict[str, str]] = {"admin": {}, "capture": {}}  # key -> name shown
    queued = 0

    def send(source: Literal["admin", "capture"]) -> None:
        nonlocal queued
        keys = pending[source]
        if keys:
            jobs = api.enqueue(TuneRequest(graph_keys=list(keys), targets=[target], priority=priority, source=source))
            queued += len(jobs)
            if not vary:  # a line per job; variants get a count (there may be millions)
                for job in jobs:
                    typer.echo(f"job {job.id}  {job.status:<9} {job.graph_key[:12]}  {keys.get(job.graph_key, '')}")
            keys.clear()

    try:
        with quiet_retries(), api, _Progress(total, bool(vary)) as advance:
            for name, spec, captured in stream:
                key = Remote(api.http).register_spec(spec)
                if key != spec.graph_key:
                    raise Failure(f"{name}: the server computed graph key {key}, this client {spec.graph_key}",
                                  "use the same plancache version on both sides", ExitCode.FAILED)
                source: Literal["admin", "capture"] = "capture" if captured else "admin"
                pending[source].setdefault(key, name)
                if len(pending[source]) >= MAX_KEYS_PER_REQUEST:  # a request takes this many keys at most
                    send(source)
                advance()
            for source in pending:
                send(source)
    except (Unauthorized, Forbidden) as exc:
        raise Failure(f"{exc.message} (enqueue needs an admin token)", GIVE_ADMIN_TOKEN, ExitCode.AUTH) from None
    if vary:
        typer.echo(f"queued {queued} jobs for {total} variants")


class _Progress:
    """A progress bar of registered specs on stderr (``--vary``), else nothing."""

    def __init__(self, total: int, shown: bool) -> None:
        self.total, self.shown = total, shown
        self._bar: Any = None

    def __enter__(self) -> Any:
        if not self.shown:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("registering variants"), BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), console=Console(stderr=True), transient=False)
        self._bar.__enter__()
        task = self._bar.add_task("variants", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


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
    from ..protocol import MAX_KEYS_PER_REQUEST
    from ..spec.axes import setters

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


def _variants(specs: list[tuple[str, GraphSpec, bool]], axes: dict[str, list[int]]
              ) -> tuple[Iterator[tuple[str, GraphSpec, bool]], int]:
    """Every graph that has each axis, at every combination of the sizes, built one at a time as they are read, and
    how many; the others are skipped (said on stderr). Each graph is varied once first, so a graph vary cannot move
    is refused before anything is sent."""
    from ..spec.axes import axes_of, variants

    kept, skipped = [], []
    for name, spec, captured in specs:
        missing = [a for a in axes if a not in axes_of(spec)]
        if missing:
            skipped.append(f"skipped {name}: no axis {', '.join(missing)} (it has {', '.join(axes_of(spec)) or 'none'})")
            continue
        with _vary_failure(name):
            next(variants(spec, {a: sizes[:1] for a, sizes in axes.items()}))
        kept.append((name, spec, captured))
    if not kept:
        raise Failure(f"no graph has the axes {', '.join(axes)} to vary",
                      "vary moves SDPA forward and backward graphs along b, s_q, s_kv and s (docs/CLI.md)",
                      ExitCode.USAGE)
    for line in skipped:
        typer.echo(line, err=True)

    def stream() -> Iterator[tuple[str, GraphSpec, bool]]:
        for name, spec, captured in kept:
            with _vary_failure(name):
                for chosen, variant in variants(spec, axes):
                    label = ",".join(f"{a}={n}" for a, n in chosen.items())
                    yield f"{name} [{label}]", variant, captured

    return stream(), len(kept) * math.prod(len(sizes) for sizes in axes.values())


@contextlib.contextmanager
def _vary_failure(name: str) -> Iterator[None]:
    """A :class:`~plancache.errors.SpecError` of varying graph ``name`` as the command's failure."""
    from ..errors import SpecError

    try:
        yield
    except SpecError as exc:
        raise Failure(f"{name}: {exc.message}", "vary moves plain attention graphs (docs/CLI.md, "
                      "\"enqueue --vary\")", ExitCode.FAILED) from None


def register(app: typer.Typer) -> None:
    app.command("enqueue")(enqueue)
