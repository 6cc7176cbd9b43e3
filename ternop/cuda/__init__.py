"""CUDA backends of ternop::linear. Imported on the first CUDA call, never by `import ternop`."""
