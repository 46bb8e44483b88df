"""What ``plans list`` and ``jobs list`` print: a table about 100 columns wide that says how many of how many
plans it shows, and job lines under a header."""

from __future__ import annotations

from datetime import UTC, datetime

from plancache.cli.jobs_cmds import jobs_table
from plancache.cli.plans_cmds import plans_table
from plancache.protocol import Job, TargetEnvironment
from tests.factories import H200, make_record, new_signer


def test_plans_list_fits_100_columns_and_says_of_how_many():
    signer = new_signer()
    env = H200.model_copy(update={"device_name": "NVIDIA H200 NVL with a long marketing name"})
    records = [make_record(f"{i:064x}", env, signer=signer, worker_id="w" * 60) for i in range(100)]
    text = plans_table(records, total=209)
    lines = text.splitlines()
    assert lines[0].startswith("100 of 209 plans") and "--limit" in lines[0], lines[0]
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    header = lines[1]
    for column in ("graph key", "env id", "GPU", "cuDNN", "tuned ms", "vs heur.", "signer", "created"):
        assert column in header
    assert f"{0:064x}"[:16] in text and H200.env_id[:12] in text and signer.key_id[:8] in text
    assert "1.60x" in text  # heuristic 0.08 ms over tuned 0.05 ms


def test_plans_list_title_counts_what_it_shows_when_it_shows_all():
    records = [make_record(f"{i:064x}", H200) for i in range(3)]
    assert plans_table(records, total=3).splitlines()[0] == "3 plans"
    assert plans_table(records, total=9, offset=6).splitlines()[0].startswith("3 of 9 plans from #7")


def test_jobs_list_has_a_header_over_its_columns():
    now = datetime.now(UTC)
    jobs = [Job(id=12, graph_key="a" * 64, target=TargetEnvironment(sm=90), status="failed", priority=0, attempts=3,
                max_attempts=3, error="no candidate passed\nmore", created_at=now, updated_at=now, source="auto")]
    header, row = jobs_table(jobs).splitlines()
    assert header.split() == ["id", "status", "tries", "source", "graph", "key", "target", "/", "error"]
    assert row.split()[:5] == ["12", "failed", "3/3", "auto", "a" * 16] and row.endswith("[sm=90]  no candidate passed")
    assert header.index("status") == row.index("failed") and header.index("source") == row.index("auto")
