"""Write the CRD schemas the deployment tests validate against, from the projects' own CRDs.

    python tests/deploy/schemas/extract.py KSERVE_CHECKOUT PROMETHEUS_OPERATOR_CHECKOUT

reads KServe's `config/crd/full/serving.kserve.io_{clusterservingruntimes,inferenceservices}.yaml`
(kserve/kserve; the files here: commit aaac4e294dae, 2026-08-21) and the Prometheus Operator's
`example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml`
(prometheus-operator/prometheus-operator; commit 6adcebc5076c, 2026-08-08), and writes each
one's `openAPIV3Schema` here as JSON. The InferenceService schema is trimmed to what hloserve's
sample uses: the predictor's framework-specific fields (sklearn, triton, ...) and its
workerSpec, and the transformer, explainer and canary sections are dropped; what is kept is
unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
FRAMEWORKS = [
    "huggingface", "lightgbm", "onnx", "paddle", "pmml", "pytorch", "sklearn", "tensorflow",
    "triton", "xgboost", "workerSpec",
]  # fmt: skip


def _trim_inference_service(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]["properties"]
    del spec["transformer"], spec["explainer"], spec["canary"]
    for name in FRAMEWORKS:
        del spec["predictor"]["properties"][name]


CRDS = [  # (which checkout, CRD file, version, written to, trimmed by)
    (0, "config/crd/full/serving.kserve.io_clusterservingruntimes.yaml", "v1alpha1",
     "clusterservingruntime.v1alpha1.json", None),
    (0, "config/crd/full/serving.kserve.io_inferenceservices.yaml", "v1beta1",
     "inferenceservice.v1beta1.json", _trim_inference_service),
    (1, "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml", "v1",
     "servicemonitor.v1.json", None),
]  # fmt: skip


def main(checkouts: list[Path]) -> None:
    for which, path, version, out, trim in CRDS:
        crd = yaml.safe_load((checkouts[which] / path).read_text())
        (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
        if trim is not None:
            trim(schema)
        (HERE / out).write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:3]])
