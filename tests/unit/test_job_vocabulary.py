"""Job statuses and job ids are defined once (:mod:`plancache.protocol`) and every part reads them from there: the
table's CHECK and partial indexes, the store, the server's routes, the status page and the CLI."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import TypeAdapter, ValidationError

from plancache.protocol import (
    ACTIVE_JOB_STATUSES,
    FINISHED_JOB_STATUSES,
    JOB_STATUSES,
    MAX_JOB_ID,
    Job,
    JobId,
    JobStatus,
    MissReason,
    PlanRecord,
    is_job_id,
)
from plancache.validation import INT32_MAX


def test_the_statuses_are_one_list_split_into_active_and_finished():
    assert JOB_STATUSES == get_args(JobStatus) == ("queued", "running", "succeeded", "failed")
    assert sorted(ACTIVE_JOB_STATUSES + FINISHED_JOB_STATUSES) == sorted(JOB_STATUSES)


def test_the_stored_strings_and_the_index_conditions_stay_the_migrations():
    from plancache.store.models import jobs

    checks = {str(c.sqltext) for c in jobs.constraints if getattr(c, "sqltext", None) is not None}
    assert "status IN ('queued', 'running', 'succeeded', 'failed')" in checks
    where = {i.name: str(i.dialect_options["postgresql"]["where"]) for i in jobs.indexes}
    assert where["uq_jobs_active_target"] == "status IN ('queued', 'running')"
    assert where["ix_jobs_finished"] == "status IN ('failed', 'succeeded')"


def test_the_status_page_and_the_cli_know_every_status():
    from typer.testing import CliRunner

    from plancache.cli import app
    from plancache.server.status_page import STATUS_ORDER

    assert set(STATUS_ORDER) == set(JOB_STATUSES)
    out = CliRunner().invoke(app, ["jobs", "list", "--help"], terminal_width=200).output
    assert f"[{'|'.join(JOB_STATUSES)}]" in out
    refused = CliRunner().invoke(app, ["jobs", "list", "--status", "done"])
    assert refused.exit_code == 2 and "'done'" in refused.output


def test_a_job_id_has_one_bound_everywhere():
    assert MAX_JOB_ID == INT32_MAX  # jobs.id is an INTEGER column
    ids = TypeAdapter(JobId)
    assert ids.validate_python(1) == 1 and ids.validate_python(MAX_JOB_ID) == MAX_JOB_ID
    for bad in (0, -1, MAX_JOB_ID + 1, True):
        with pytest.raises(ValidationError):
            ids.validate_python(bad)
    assert is_job_id(1) and is_job_id(MAX_JOB_ID) and not is_job_id(0) and not is_job_id(MAX_JOB_ID + 1)
    for model, field in ((Job, "id"), (PlanRecord, "job_id"), (MissReason, "job_id")):
        schema = model.model_json_schema()["properties"][field]
        bounded = schema if "maximum" in schema else next(s for s in schema["anyOf"] if "maximum" in s)
        assert (bounded["minimum"], bounded["maximum"]) == (1, MAX_JOB_ID), model
