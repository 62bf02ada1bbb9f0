"""job choices: the choices after the first of a request with n > 1 (the first stays in output & co.)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('choices', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('choices')
