"""tenant prefix-cache group: tenants that share cached prompt prefixes (admin opt-in)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('prefix_cache_group', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('prefix_cache_group')
