"""A node's health: `launch doctor`'s checks and run, and the verdict every launch's pre-start
check passes on the nodes' GPUs and NICs.

- launcher.health.checks: one `Check` per column, a `NodeReport` per node, and the judges of a
  node's GPUs, NICs, receive-datapath manager and of drift across nodes, which the pre-start
  verdict and `launch doctor` share;
- launcher.health.prestart: the launch's pre-start verdict (`prestart_verdict`);
- launcher.health.script: `launch doctor`'s read-only node program;
- launcher.health.report: `launch doctor`'s verdict on the answers (`judge`, `Report`);
- launcher.health.doctor: the `launch doctor` run (`run_doctor`), which launcher.cli.cmd_doctor
  parses for and renders.

Where the line with launcher.core runs, and why. This package imports core (the run opens core's
sessions, the report speaks core's `Node`), so core must not import it. The questions a launch
asks a node about its hardware (launcher.core.prestart: the catalog's `Expectation` and the
statements that print `key=value` lines) stay in core: they are part of the node program, which
core's builder renders from the request alone, on the launching machine and in a detached job's
controller, so both render the same program byte for byte; injecting them from above would make
every caller that builds a program (the runner, the controller, a recovery's relaunch) add them,
or render a different program. The judgement of the answers moves here: core takes it as a
value, the `verdict` a `Launch` (and launcher.core.preflight.check_probes) is given, which the
runner's plan carries (launcher.runner.LaunchPlan.verdict) and the controller, a recovery and the
bad-node finder pass. Core refuses to run a check whose nodes answered the GPU questions without
a verdict, so a caller cannot skip the judgement by forgetting it.
"""

from __future__ import annotations

from launcher.health.checks import CHECKS, FAIL, OK, SKIP, WARN, Check, NodeReport
from launcher.health.doctor import Doctor, doctor_programs, run_doctor, to_json
from launcher.health.prestart import prestart_verdict
from launcher.health.report import Report, judge
from launcher.health.script import node_script

__all__ = [
    "CHECKS",
    "FAIL",
    "OK",
    "SKIP",
    "WARN",
    "Check",
    "Doctor",
    "NodeReport",
    "Report",
    "doctor_programs",
    "judge",
    "node_script",
    "prestart_verdict",
    "run_doctor",
    "to_json",
]
