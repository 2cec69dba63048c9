"""The zoo's detector: the compiled part decodes SSDLite's boxes and scores (static shapes);
this file keeps the data-dependent part, per-class score threshold, top-k and non-maximum
suppression, in numpy (what torchvision's `SSD.postprocess_detections` does)."""

from __future__ import annotations

import numpy as np

from hloserve import NamedTensor, register_model

SCORE_THRESHOLD = 0.001  # torchvision's SSDLite defaults
TOPK_PER_CLASS = 300
IOU_THRESHOLD = 0.55
DETECTIONS = 100  # per image, padded: label -1 and score 0 mark the padding


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Indices kept by greedy non-maximum suppression, highest score first (xyxy boxes)."""
    order = np.argsort(-scores, kind="stable")
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep = []
    while order.size:
        best, rest = order[0], order[1:]
        keep.append(best)
        top_left = np.maximum(boxes[best, :2], boxes[rest, :2])
        bottom_right = np.minimum(boxes[best, 2:], boxes[rest, 2:])
        overlap = np.prod(np.clip(bottom_right - top_left, 0, None), axis=1)
        iou = overlap / (areas[best] + areas[rest] - overlap)
        order = rest[iou <= iou_threshold]
    return np.asarray(keep, np.int64)


def detect(boxes: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's detections from decoded boxes (A, 4) and class scores (A, C), class 0 the
    background: (DETECTIONS, 4) boxes, (DETECTIONS,) scores, (DETECTIONS,) labels."""
    kept_boxes, kept_scores, kept_labels = [], [], []
    for label in range(1, scores.shape[1]):
        candidates = np.flatnonzero(scores[:, label] > SCORE_THRESHOLD)
        candidates = candidates[np.argsort(-scores[candidates, label], kind="stable")[:TOPK_PER_CLASS]]
        keep = candidates[nms(boxes[candidates], scores[candidates, label], IOU_THRESHOLD)]
        kept_boxes.append(boxes[keep])
        kept_scores.append(scores[keep, label])
        kept_labels.append(np.full(len(keep), label, np.int64))
    all_scores = np.concatenate(kept_scores)
    best = np.argsort(-all_scores, kind="stable")[:DETECTIONS]
    out_boxes = np.zeros((DETECTIONS, 4), np.float32)
    out_scores = np.zeros(DETECTIONS, np.float32)
    out_labels = np.full(DETECTIONS, -1, np.int64)
    out_boxes[: len(best)] = np.concatenate(kept_boxes)[best]
    out_scores[: len(best)] = all_scores[best]
    out_labels[: len(best)] = np.concatenate(kept_labels)[best]
    return out_boxes, out_scores, out_labels


def postprocess(outputs: list[NamedTensor]) -> list[NamedTensor]:
    tensors = {t.name: t.data for t in outputs}
    found = [detect(b, s) for b, s in zip(tensors["boxes"], tensors["scores"], strict=True)]
    return [
        NamedTensor("detection_boxes", np.stack([f[0] for f in found])),
        NamedTensor("detection_scores", np.stack([f[1] for f in found])),
        NamedTensor("detection_labels", np.stack([f[2] for f in found])),
    ]


register_model("ssdlite320_mobilenet_v3_large", postprocess=postprocess)
