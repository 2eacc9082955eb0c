"""The monitor's settings (one frozen Config) and its YAML file: settings, alert rules, webhooks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stragglers.config import Config, setting
from stragglers.errors import InputError
from stragglers.trace.jsontypes import JsonObject


@dataclass(frozen=True)
class MonitorConfig(Config):
    """How windows close, when jobs stall or finish, and how much a client may send."""

    window_steps: int = setting(10, "recorded steps per analysis window", minimum=1,
                                maximum=100_000)
    stall_after_s: float = setting(120.0, "a job with no new part for this long is stalled "
                                   "(its open window closes with the ranks it has)", minimum=0.1)
    file_time_slack_s: float = setting(1.0, "a watched part is taken as arrived when its file "
                                       "got its name or contents (ctime), if that lies at most "
                                       "this long before the watcher noticed it (else this long "
                                       "before): silence then counts from the write, not from "
                                       "the watcher's and ingest's delays, and a writer or file "
                                       "server clock that is wrong moves a silence alert "
                                       "earlier by at most this", minimum=0.0, maximum=60.0)
    finish_after_s: float = setting(3600.0, "a job silent for this long is finished", minimum=0.1)
    gap_wait_s: float = setting(30.0, "how long a missing part of a rank is waited for once a "
                                "later part of that rank arrived", minimum=0.0)
    close_grace_s: float = setting(3.0, "after the recorder's close marker, a job is finished "
                                   "once no part arrived for this long (late ranks' last parts)",
                                   minimum=0.0)
    max_part_bytes: int = setting(64 * 2**20, "largest accepted part upload (bytes)",
                                  minimum=1024)
    max_upload_bytes_held: int = setting(256 * 2**20, "bytes of upload bodies (parts, "
                                         "meta.json) held at once (received and not yet "
                                         "stored); past it an upload is "
                                         "answered 503 and the recorder retries it later",
                                         minimum=1024)
    max_uploads_per_writer: int = setting(64, "uploads in progress from one writer (a bearer "
                                          "token and a client address); past it 429 and the "
                                          "recorder retries", minimum=1)
    max_upload_bytes_per_writer: int = setting(64 * 2**20, "bytes of upload bodies one writer "
                                               "may hold at once (one body alone is always "
                                               "let in); past it 429", minimum=1024)
    max_connections: int = setting(1000, "HTTP connections served at once; past it new ones "
                                   "are answered 503 (an idle or slow client cannot take every "
                                   "file descriptor)", minimum=8)
    max_connections_per_client: int = setting(256, "connections one client address may "
                                              "hold open; past it (or past max_connections) "
                                              "its oldest idle one is closed, and a new one is "
                                              "refused 503 only when all are busy", minimum=1)
    header_timeout_s: float = setting(10.0, "a request's head must arrive within this long of "
                                      "its first byte (or of the connection)", minimum=0.5)
    keep_alive_s: float = setting(30.0, "an idle keep-alive connection is closed after this "
                                  "long", minimum=1.0)
    body_min_bytes_per_s: float = setting(8192.0, "a request body slower than this (after a "
                                          "10 s grace) is cut with 408", minimum=1.0)
    allowed_hosts: str = setting("", "Host names accepted besides the loopback names, comma "
                                 "separated ('*': any); empty: loopback names only on a "
                                 "loopback address, any name on another")
    max_meta_bytes: int = setting(64 * 2**10, "largest meta.json besides its per-rank lists "
                                  "(extra.layout, extra.clock: at most 1 KiB per rank more)",
                                  minimum=1024)
    meta_changes_per_minute: float = setting(6.0, "changed meta.json bodies one writer (a "
                                             "token and a client address; from loopback, "
                                             "per job) may send per minute after a burst of 4, "
                                             "while another job uploads parts: a change sooner "
                                             "waits its turn, or is answered 429 with "
                                             "Retry-After when that is more than 8 s off (a "
                                             "recorder changes its job's a few times a run; "
                                             "2 clients changing a 48 KB meta.json before "
                                             "every part made another job's uploads 3.9x "
                                             "slower)", minimum=0.1)
    max_jobs: int = setting(10_000, "jobs the monitor keeps track of at once, finished "
                            "ones not counted", minimum=1)
    max_world_size: int = setting(65_536, "ranks one job may declare (meta.json world_size): "
                                  "the per-rank state (frontiers, silence, change detection) "
                                  "follows the declared world, and a meta.json of 1,000,000 "
                                  "ranks, four of which sent a part, held 1.4 GB", minimum=1,
                                  maximum=10_000_000)
    max_silent_alerts: int = setting(256, "rank_silent alerts one job raises at most (those "
                                     "quiet longest; stragglers_silent_ranks counts every "
                                     "silent rank): a meta.json declaring a world of 1,000,000 "
                                     "ranks and four that send once raised an alert for each "
                                     "of the others, GBs of memory", minimum=1)
    max_job_bytes: int = setting(16 * 2**30, "bytes of parts not analysed yet (holding steps "
                                 "past the job's last window) one job may hold (uploads and "
                                 "watched files alike); past it the job's further parts are "
                                 "refused (an upload 507, a watched file named in the log "
                                 "and /api/stats): one job's backlog cannot fill the "
                                 "monitor's disk; parts analysed do not count",
                                 minimum=1024)
    empty_job_expiry_s: float = setting(3600.0, "an uploaded job that stored no part this long "
                                        "after its last meta.json is forgotten (its row and "
                                        "folder go, freeing its place in max_jobs; at the "
                                        "default rates fewer than 7,200 empty jobs can exist "
                                        "at once); a job whose first part comes later must "
                                        "PUT its meta again", minimum=0.01)
    new_jobs_per_minute: float = setting(120.0, "jobs that may be created per minute by "
                                         "uploads, in all (past it 429 with Retry-After: the "
                                         "uploader retries)", minimum=0.1)
    new_jobs_per_client_per_minute: float = setting(30.0, "the same, per client address (a "
                                                    "loopback client has no address quota: "
                                                    "the total bounds it)", minimum=0.1)
    read_interval_s: float = setting(0.25, "/metrics, /api/jobs, /api/jobs/{job}, /api/alerts "
                                     "and /api/stats answer one client address at most once "
                                     "per this long each (more "
                                     "requests wait their turns): loops of reads took the CPUs "
                                     "from uploads; 0: no pace", minimum=0.0, maximum=60.0)
    repeat_s: float = setting(4 * 3600.0, "a still-firing alert is sent again after this long",
                              minimum=1.0)
    tick_s: float = setting(0.5, "how often job states and time-based rules are checked",
                            minimum=0.01, maximum=60.0)
    durable: bool = setting(True, "fsync every commit (a part acknowledged survives a power cut)")
    lease_s: float = setting(10.0, "a job is analysed by the instance holding its lease, renewed "
                             "every lease_s / 3; an instance that stops (kill -9) has its jobs "
                             "taken by another within lease_s plus one heartbeat", minimum=0.3,
                             maximum=3600.0)
    alert_claim_s: float = setting(30.0, "an alert message claimed by an instance for sending "
                                   "is sent by another once this passed without it being marked "
                                   "delivered (its sender died)", minimum=0.5, maximum=3600.0)
    read_threads: int = setting(2, "threads that read the part files of an ingest batch "
                                "(Parquet decoding runs outside the GIL)", minimum=1, maximum=64)
    read_timeout_s: float = setting(5.0, "a watched or stored part file's read (open, footer, "
                                    "bytes) not returned after this long is given up on: the "
                                    "file is left for a later scan (a window goes without its "
                                    "rows), its thread left behind (a hard-mounted NFS or a "
                                    "hung FUSE file blocks a read for good); /health's "
                                    "stuck_reads counts them", minimum=0.01, maximum=3600.0)
    write_threads: int = setting(2, "threads that write and fsync the uploaded parts of an "
                                 "ingest batch", minimum=1, maximum=64)
    analysis_process: bool = setting(False, "analyse windows in a separate, spawned process "
                                     "(the what-if engine then leaves the ingest threads' "
                                     "interpreter lock alone); `stragglers monitor serve` turns "
                                     "it on; off by default in a program that embeds the "
                                     "monitor, whose main script a spawned process re-imports")
    analysis_timeout_s: float = setting(300.0, "one window's what-if analysis may take this "
                                        "long (the engine takes ~5 s per 800,000 rows): past "
                                        "it the analysis process is killed and replaced and "
                                        "the window stored with an error row saying so (on "
                                        "the thread, analysis_process: false, the engine "
                                        "cannot be stopped: the window gets its error row, "
                                        "the engine runs on, its result dropped)",
                                        minimum=0.1)
    analysis_start_timeout_s: float = setting(120.0, "the analysis process must start a "
                                              "window within this long of its hand-over (a "
                                              "process starting and importing the engine "
                                              "takes ~1 s): past it the process is killed "
                                              "and replaced and the window stored with an "
                                              "error row saying so (a process hung while "
                                              "starting held every window)", minimum=0.1)
    analysis_answer_max_bytes: int = setting(64 * 2**20, "a window's answer from the analysis "
                                             "process (its row and refused parts, pickled) "
                                             "is at most this: a larger one is not read into "
                                             "the service, the window is stored with an error "
                                             "row naming this cap and the job goes on (a "
                                             "4-worker window's answer is ~1 KB, a 256-worker "
                                             "one's ~9 KB)", minimum=512)
    rescan_s: float = setting(10.0, "watched directories are also rescanned this often (file "
                              "systems that drop change events)", minimum=0.1)
    change_detector: bool = setting(True, "the fast detector (changes.py): a rank whose busy "
                                    "time per step rises against its peers and its own "
                                    "baseline alerts (rank_slowdown) within a few steps, "
                                    "before its window is analysed")
    change_min_ratio: float = setting(1.2, "least slowdown of a rank (busy time relative to its "
                                      "peers, against its baseline) that alerts", minimum=1.01,
                                      maximum=100.0)
    change_threshold: float = setting(16.0, "CUSUM decision interval in σ of the rank's own "
                                      "noise (each step adds at most 3.5): higher alerts later "
                                      "and more rarely by chance", minimum=2.0, maximum=1000.0)
    change_baseline_steps: int = setting(60, "steps in a rank's baseline (median and MAD of its "
                                         "recent in-control values)", minimum=8, maximum=10_000)
    change_warmup_steps: int = setting(20, "steps a rank is watched before it can alert",
                                       minimum=4, maximum=10_000)


FILE_KEYS = ("settings", "rules", "webhooks", "receiver", "external_url")


def load_config_file(path: Path | None) -> JsonObject:
    """Read the monitor's YAML file: {settings, rules, webhooks, receiver, external_url}."""
    if path is None:
        return {}
    from stragglers.smallfiles import load_yaml_file

    raw = load_yaml_file(path, "the monitor's YAML rules file")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputError(path, None, f"expected a mapping with keys {', '.join(FILE_KEYS)}")
    unknown = sorted(set(raw) - set(FILE_KEYS))
    if unknown:
        raise InputError(path, unknown[0], f"unknown key; expected one of {', '.join(FILE_KEYS)}")
    return raw
