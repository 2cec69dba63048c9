"""hloserve.engine: the dispatcher, the weight cache, admission, statistics, alone and live."""
