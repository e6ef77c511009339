"""metrics.jsonl: strict JSON with non-finite values, a header per run, resumes resolved."""

import json
import math

from torchtitan_tide.metrics import RESUME, RUN_START, JsonlLogger, read_metrics, to_json_line


def write_run(path, steps, values=None, header=None):
    logger = JsonlLogger(str(path), header or {"comm": "fsdp2", "steps": max(steps)})
    for step in steps:
        logger.log({"loss": (values or {}).get(step, float(step))}, step)
    logger.close()
    return logger.run_id


def test_non_finite_values_stay_valid_json(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, [1, 2, 3], values={1: float("nan"), 2: float("inf"), 3: -float("inf")})
    lines = path.read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
               for line in lines]  # bare NaN/Infinity would raise here
    assert [r["loss"] for r in records if "step" in r] == ["nan", "inf", "-inf"]
    assert math.isnan(float(records[1]["loss"])) and float(records[2]["loss"]) == math.inf
    assert to_json_line({"x": [float("nan")], "y": {"z": 1.5}}) == '{"x": ["nan"], "y": {"z": 1.5}}'


def test_header_per_run_and_fresh_run_replaces_earlier_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = write_run(path, range(1, 121), header={"comm": "fsdp2", "steps": 120, "config": {"a": 1}})
    second = write_run(path, range(1, 21), header={"comm": "tide", "steps": 20})
    headers = [json.loads(line) for line in path.read_text().splitlines()
               if json.loads(line).get("event") == RUN_START]
    assert [h["run_id"] for h in headers] == [first, second]
    assert headers[0]["comm"] == "fsdp2" and headers[0]["config"] == {"a": 1}
    assert headers[1]["steps"] == 20 and "start_time" in headers[1]
    records = read_metrics(tmp_path)  # the folder works as well as the file
    assert [r["step"] for r in records] == list(range(1, 21))
    assert {r["run_id"] for r in records} == {second}
    assert len(path.read_text().splitlines()) == 2 + 120 + 20  # nothing deleted


def test_resume_supersedes_later_steps_without_losing_earlier_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = write_run(path, range(1, 13))  # crashed after step 12, checkpoint at 8
    resumed = write_run(path, range(9, 21), values={s: 100.0 + s for s in range(9, 21)})
    again = write_run(path, range(17, 25), values={s: 200.0 + s for s in range(17, 25)})
    markers = [json.loads(line) for line in path.read_text().splitlines()
               if json.loads(line).get("event") == RESUME]
    assert [(m["run_id"], m["first_step"]) for m in markers] == [(resumed, 9), (again, 17)]
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(1, 25))
    by_step = {r["step"]: r for r in records}
    assert by_step[8]["run_id"] == first and by_step[8]["loss"] == 8.0
    assert by_step[12]["run_id"] == resumed and by_step[12]["loss"] == 112.0
    assert by_step[20]["run_id"] == again and by_step[20]["loss"] == 220.0


def test_files_without_headers_read_as_one_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in (1, 2, 3)))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
