"""transformers, loaded in a replica's process without what it imports for no use of ours:
called before the tokenizer or vLLM first import transformers' models."""


def skip_scikit_learn() -> None:
    """transformers imports scikit-learn wherever it is installed (a test extra's embedding
    model brings it), for assisted generation's confidence threshold alone
    (transformers.generation.candidate_generator), which neither vLLM nor a tokenizer runs:
    1-2 s of CPU at each replica's start on 2 cores (2026-12-07)."""
    try:
        import transformers.utils as hf_utils
        from transformers.utils import import_utils
    except ImportError:  # the import that follows says what is missing
        return
    hf_utils.is_sklearn_available = import_utils.is_sklearn_available = lambda: False
