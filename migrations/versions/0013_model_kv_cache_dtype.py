"""model kv_cache_dtype: a registered model's own KV cache dtype (NULL: the deployment's) and its KV calibration

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.add_column(sa.Column('kv_cache_dtype', sa.String(length=16), nullable=True))
        batch.add_column(sa.Column('kv_cache_calibration', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.drop_column('kv_cache_calibration')
        batch.drop_column('kv_cache_dtype')
