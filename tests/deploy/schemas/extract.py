"""Write the KServe schemas the deployment tests validate against, from KServe's CRDs.

    python tests/deploy/schemas/extract.py KSERVE_CHECKOUT

reads `config/crd/full/serving.kserve.io_{clusterservingruntimes,inferenceservices}.yaml` of a
kserve/kserve checkout (the files here: commit aaac4e294dae, 2026-08-21) and writes each
served version's `openAPIV3Schema` here as JSON. The InferenceService schema is trimmed to what
hloserve's sample uses: the predictor's framework-specific fields (sklearn, triton, ...) and
its workerSpec, and the transformer, explainer and canary sections are dropped; what is kept is
unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CRDS = {
    "clusterservingruntimes": ("v1alpha1", "clusterservingruntime.v1alpha1.json"),
    "inferenceservices": ("v1beta1", "inferenceservice.v1beta1.json"),
}
FRAMEWORKS = [
    "huggingface", "lightgbm", "onnx", "paddle", "pmml", "pytorch", "sklearn", "tensorflow",
    "triton", "xgboost", "workerSpec",
]  # fmt: skip


def main(checkout: Path) -> None:
    for plural, (version, out) in CRDS.items():
        crd = yaml.safe_load((checkout / f"config/crd/full/serving.kserve.io_{plural}.yaml").read_text())
        (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
        if plural == "inferenceservices":
            spec = schema["properties"]["spec"]["properties"]
            del spec["transformer"], spec["explainer"], spec["canary"]
            for name in FRAMEWORKS:
                del spec["predictor"]["properties"][name]
        (HERE / out).write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
