"""model tensor_parallel_size: a registered model's own tensor-parallel size (NULL: the deployment's)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.add_column(sa.Column('tensor_parallel_size', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.drop_column('tensor_parallel_size')
