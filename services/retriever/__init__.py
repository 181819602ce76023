"""The retriever service: collections of documents, chunked, embedded and
searched with an ANN index, for retrieval-augmented generation."""
