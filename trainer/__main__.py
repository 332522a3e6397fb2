"""`python -m trainer [group=choice ...] [key=value ...]`: the same command as `python train.py`."""

from trainer.cli import main

if __name__ == "__main__":
    main()
