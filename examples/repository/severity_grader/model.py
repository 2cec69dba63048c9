"""Post-processing of ReactantServer.jl's severity grader: CORAL ordinal logits to a grade.

The grade is the number of consecutive leading logits above zero, stopping at the first that is
not. That early break is awkward as a static XLA graph and a plain loop here.
"""

import numpy as np

from hloserve import NamedTensor, register_model


def postprocess(outputs: list[NamedTensor]) -> list[NamedTensor]:
    logits = outputs[0].data  # OUTPUT__0, float32 [batch, 9]
    grade = np.zeros((logits.shape[0], 1), dtype=np.int64)
    for b, row in enumerate(logits):
        n = 0
        for i, logit in enumerate(row, start=1):
            if logit <= 0:
                break
            n = i
        grade[b, 0] = n
    return [NamedTensor("grade", grade)]


register_model("severity_grader", postprocess=postprocess)
