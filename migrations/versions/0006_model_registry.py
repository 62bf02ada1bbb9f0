"""model registry: the models table, per-tenant model allow-lists, and the model each job runs on

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'models',
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('source', sa.String(length=1024), nullable=False),
        sa.Column('tier', sa.String(length=8), nullable=False),
        sa.Column('enabled', sa.Boolean(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_models')),
    )
    with op.batch_alter_table('quotas') as batch:
        batch.add_column(sa.Column('allowed_models', sa.JSON(), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('model', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('model')
    with op.batch_alter_table('quotas') as batch:
        batch.drop_column('allowed_models')
    op.drop_table('models')
