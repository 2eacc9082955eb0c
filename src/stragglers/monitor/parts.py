"""One part (a flushed Parquet file of one rank): the names the rest of the monitor imports.

Its identity (part_names), the bounds checked before decoding (part_limits), its file on disk
(part_files), its footer (part_footers) and its rows (part_rows) live in their own modules.
"""

from __future__ import annotations

from stragglers.monitor.part_files import (MAX_PART_FILE_BYTES, open_part_file, sync_directory,
                                           write_part_file)
from stragglers.monitor.part_footers import (PartFile, check_file_in_job, check_uploads,
                                             read_part_footer, read_part_footers, read_upload)
from stragglers.monitor.part_limits import (ALLOWED_COLUMNS, MAX_DECODED_BYTES,
                                            MAX_FOOTER_BYTES, MAX_PART_ROWS, MAX_STEP,
                                            MAX_STEP_GAP, check_decode_budget,
                                            check_page_headers, check_part_rows,
                                            check_step_gaps, decoded_bound, footer_length)
from stragglers.monitor.part_names import (JOB_NAME, MAX_PART, MAX_RANK, MAX_WINDOW,
                                           PartConflict, check_job_name, check_same_part, is_job_name,
                                           fingerprint, is_whole_rank_file, parse_part_name,
                                           part_path)
from stragglers.monitor.part_rows import (PartData, check_in_job, check_part, check_parts,
                                          parquet_file, read_part_file, read_part_files,
                                          read_small_parquet, read_uploads, read_window_rows)

__all__ = [
    "ALLOWED_COLUMNS", "JOB_NAME", "MAX_DECODED_BYTES", "MAX_FOOTER_BYTES", "MAX_PART",
    "MAX_PART_FILE_BYTES", "MAX_PART_ROWS", "MAX_RANK", "MAX_STEP", "MAX_STEP_GAP", "MAX_WINDOW",
    "check_decode_budget", "check_file_in_job", "check_in_job", "check_job_name",
    "check_page_headers", "check_part", "check_part_rows", "check_parts", "check_same_part",
    "check_step_gaps", "check_uploads", "decoded_bound", "fingerprint", "footer_length",
    "is_job_name", "is_whole_rank_file", "open_part_file", "parquet_file", "parse_part_name", "part_path",
    "PartConflict", "PartData", "PartFile", "read_part_file", "read_part_files",
    "read_part_footer", "read_part_footers", "read_small_parquet", "read_upload", "read_uploads",
    "read_window_rows", "sync_directory", "write_part_file",
]
