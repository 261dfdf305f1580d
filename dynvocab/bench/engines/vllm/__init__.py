"""``dynvocab bench --vllm``: the rows' measurement in the parent (:mod:`.rows`: requests, schedules, summaries, the
table; :mod:`.answers`: ``train-draft``'s answers and the replayed turns' history; :mod:`.replay`: a conversation's
turns), and the child process that holds the engines (:mod:`.driver`: engines, stat loggers, rounds, ``python -m``;
:mod:`.worker`: the worker extension that switches and times heads). Only the child imports vLLM."""
