"""DLRM / DLRM-DCNv2 reference training pipeline."""
