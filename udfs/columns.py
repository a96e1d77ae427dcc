"""Reserved column names: the one place they are spelled.

Public columns are written to the output. Internal ones (``__overnight_*``) carry state between
stages and are dropped before a part is written.
"""

import pyarrow as pa

# Added to the output when the input has no id column: the row's position in the input.
ROW_ID = "row_id"

# With sampling.n > 1: which of the row's samples this output row is (0-based).
SAMPLE_INDEX = "sample_index"

# Added to every output row, after the generated-text column (whose name the job chooses).
FINISH_REASON = "finish_reason"  # "stop", "length", "skipped", or null on error
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
ERROR_KIND = "error_kind"  # a short code: see ErrorKind
ERROR = "error"  # null when the row succeeded; else one line saying what went wrong
GENERATED = (FINISH_REASON, PROMPT_TOKENS, COMPLETION_TOKENS, ERROR_KIND, ERROR)
# With model.reasoning_parser: the tokens of completion_tokens the model spent thinking (its
# thinking itself is in output.reasoning_column), after completion_tokens
REASONING_TOKENS = "reasoning_tokens"
# A generate job's last column: 32 hex digits over what determines the row's generation (the
# job's settings that do, and the row's values its prompt reads); a re-run with output.reuse
# carries over the rows whose key it finds in the earlier output (pipelines/reuse/carry.py)
REQUEST_KEY = "request_key"
# A job with prompt.images: how many images the row's prompt held, and the prompt tokens they
# took (the engine's count of the prompt, less its text's), after completion_tokens
IMAGE_COUNT = "image_count"
IMAGE_TOKENS = "image_tokens"

# Internal: the row's 0-based position in the whole input, across files. Orders the output
# and names the parts, so a resumed job knows which rows are done without reading them.
ORDINAL = "__overnight_ordinal"
# Internal: the row's place in the order a job runs its rows, where that is not the input's (a
# job whose rows are grouped by prompt prefix, pipelines/order/): it cuts the blocks and names
# the parts in place of ORDINAL, which still says which input row it is.
POSITION = "__overnight_position"


def place_column(table: pa.Table) -> str:
    """The column that places a table's rows in the job's run: POSITION where it has one."""
    return POSITION if POSITION in table.column_names else ORDINAL


PROMPT_TOKEN_IDS = "__overnight_prompt_token_ids"
PROMPT_MESSAGES = "__overnight_prompt_messages"  # JSON; only for an engine that wants them
# A prompt's images, in the order it holds them (udfs/rows/images.py): each its bytes or its path
# or URL, loaded and decoded where the engine takes them
PROMPT_IMAGES = "__overnight_prompt_images"
PROMPT_IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.large_binary()),
                                         ("path", pa.large_string())]))
SEED = "__overnight_seed"
# With SAMPLE_INDEX: how many samples the row has. The writer tells by it a row that Ray Data
# cut between two of its samples (pipelines/write/: a part holds whole input rows).
SAMPLES = "__overnight_samples"
# Set by the predictor on every row of a block, read by the writer into the part's record (the
# run report's per-replica and over-time numbers): which replica generated the block, when its
# engine was ready and when the block's generation finished (Unix seconds).
REPLICA = "__overnight_replica"
READY_AT = "__overnight_ready_at"
# and each request's prompt tokens its engine's prefix cache held (the report's hit rate)
CACHED_TOKENS = "__overnight_cached_tokens"
DONE_AT = "__overnight_done_at"
INTERNAL_PREFIX = "__overnight_"


class ErrorKind:
    """Values of the ``error_kind`` column."""

    NULL_FIELD = "null_field"  # a template column is null in this row
    RENDER = "render_error"  # the template failed on this row's values
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_tokens exceeds max_model_len
    ENGINE = "engine_error"  # the engine rejected or failed this request
    ENGINE_CRASH = "engine_crash"  # engines died whenever this row reached them
    OVERRIDES = "invalid_overrides"  # the row's sampling overrides (overrides_column) are bad
    PARSE = "parse_error"  # structured output did not parse or validate (e.g. cut off)
    FILTER = "filter_error"  # a step's where cannot be evaluated on this row's values
    # a thinking model (model.reasoning_parser) ended before its answer: its thinking used
    # all of max_tokens, or it stopped while thinking; its thinking is kept
    NO_ANSWER = "no_answer"
    # the row's adapter column names a LoRA adapter the job does not declare (model.adapters)
    ADAPTER = "unknown_adapter"
    # an image of the row cannot be used: missing, not an image, truncated, over the pixel
    # cap, or null (prompt.on_null: error)
    IMAGE = "image_error"


class FinishReason:
    SKIPPED = "skipped"  # on_too_long: skip

# task: score (udfs/stages/pooler.py): where the document starts in the pair's token ids (for token
# types), and the two rendered texts as JSON (for a server that tokenizes pairs itself)
PAIR_START = "__overnight_pair_start"
PAIR_TEXTS = "__overnight_pair_texts"
# task: classify: the probability column of each label is this prefix and the label
PROBABILITY_PREFIX = "prob_"

# A job of several steps (udfs/stages/steps.py): each step's own columns are named after its output
# column C: C_finish_reason, C_prompt_tokens, C_completion_tokens; C_text (the raw text, where
# C holds the parsed value); C_index (which of a row's fan-out rows this one is). The job-level
# columns above (GENERATED) then hold the row's totals: its tokens over every step, the first
# error (naming its step), the last step's finish reason.
STEP_META = (FINISH_REASON, PROMPT_TOKENS, COMPLETION_TOKENS)
STEP_REASONING = "reasoning"  # with a reasoning parser: a step's thinking, C_reasoning
DROPPED_BY = "dropped_by"  # with output.keep_dropped: the step whose filter dropped the row
DROPPED = "__overnight_dropped"  # internal: the row was dropped by a step's filter
STEP_COUNTS = "__overnight_step_counts"  # internal: a block's per-step counts (JSON)


def step_column(column: str, meta: str) -> str:
    """A step's own column: ``judge`` + ``finish_reason`` -> ``judge_finish_reason``."""
    return f"{column}_{meta}"


# Parquet schema metadata, on every file a job writes: the job that wrote it (its output
# column and the columns it added), so that a job reading that output names its columns apart
# (pipelines/plan/input_checks.py); and on a part of a job with steps, its per-step counts.
JOB_METADATA = b"overnight.job"
STEPS_METADATA = b"overnight.steps"

